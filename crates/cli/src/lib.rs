//! The meshwarp command's pieces that need no node and no kernel, kept in
//! the library so other crates and unit tests reach them: the daemon's
//! layered configuration (defaults < file < environment < flags), shared
//! with the fuzz target of the config file; the table output helpers; and
//! the rendering of the observing commands (`latency`, its SVG picture,
//! `conns`, `top`) from the node's answers.

pub mod config;
pub mod conns;
pub mod latency;
pub mod output;
pub mod svg;
pub mod top;
