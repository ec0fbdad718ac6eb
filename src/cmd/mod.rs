//! The subcommands of `memwall`, one module each.

pub mod peak;
pub mod run;
pub mod scenario;
pub mod synth;
pub mod wall;
