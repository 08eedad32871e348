//! The meshwarp command's pieces other crates use: the daemon's layered
//! configuration (defaults < file < environment < flags), shared with the
//! fuzz target of the config file.

pub mod config;
