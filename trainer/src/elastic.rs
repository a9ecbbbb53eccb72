//! The elastic control plane's library parts. Today: [`policy`], the decisions an elastic
//! launch takes after each epoch (who the next epoch's members are, whether the job restarts
//! from a checkpoint, heals in place or ends), as pure functions that both launchers call (the
//! local one, `launch --local`, and the rendezvous host of a launch across machines) and that
//! are unit-tested on plain data. The host, the agents and the local supervisor (event loops
//! and processes) are still in the binary (`cli/`).

pub mod policy;
