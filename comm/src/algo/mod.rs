//! Sans-IO collective algorithms: which element ranges each rank owns, the ring and chain
//! schedules that move them, and the frames a lane sends and expects. Nothing here touches a
//! socket, a thread or a clock; the transports execute these plans, and the tests check them
//! on an in-memory cluster.

pub mod frames;
pub mod layout;
pub mod program;
pub mod ring;
pub mod scope;

pub use layout::Layout;
pub use program::Program;
pub use ring::{RecvMode, RingStep};
pub use scope::{Scope, Scopes};
