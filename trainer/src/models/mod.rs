//! Example models and their data, shared by `examples/` and `wiretrain train --example`.

pub mod mlp;
