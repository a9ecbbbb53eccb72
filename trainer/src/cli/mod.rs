//! The `wiretrain` command line: subcommands and the flags they share.

pub mod bench;
pub mod devices;
pub mod launch;
pub mod node;
pub mod train;
