//! The `wiretrain` command line: subcommands and the flags they share.

pub mod bench;
pub mod node;
