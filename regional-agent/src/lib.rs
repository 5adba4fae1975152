//! The regional agent (DESIGN §4–§5). Its behaviour is tracked by the agent
//! issue; this crate holds its place in the workspace until then.
