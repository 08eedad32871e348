//! Pins that several families share the shape of: the plugin directories
//! under a family's pin directory (`<family dir>/plugins/<id>/{prog,maps/}`),
//! removed by the family's teardown and by an unloaded plugin.

use std::fs;
use std::io;
use std::path::Path;

/// Removes every plugin pin under a family's pin directory (teardown).
pub fn remove_plugin_pins(family_dir: &Path) -> io::Result<()> {
    let root = family_dir.join("plugins");
    let Ok(entries) = fs::read_dir(&root) else {
        return Ok(());
    };
    for e in entries.flatten() {
        remove_plugin_dir(&e.path())?;
    }
    let _ = fs::remove_dir(&root);
    Ok(())
}

pub(crate) fn remove_plugin_dir(dir: &Path) -> io::Result<()> {
    if let Ok(maps) = fs::read_dir(dir.join("maps")) {
        for m in maps.flatten() {
            fs::remove_file(m.path())?;
        }
    }
    let _ = fs::remove_dir(dir.join("maps"));
    match fs::remove_file(dir.join("prog")) {
        Ok(()) => {}
        Err(e) if e.kind() == io::ErrorKind::NotFound => {}
        Err(e) => return Err(e),
    }
    fs::remove_dir(dir)
}
