//! Policy-contract fixture: clean code that must pass, violations that must fail.
//!
//! Every violating line carries a trailing `// VIOLATION: <path>[|<path>...]` marker
//! naming the disallowed item; `.ci/policy-contract` expects clippy to report one
//! of those paths at that `file:line`.

pub mod clean;

#[cfg(feature = "violations")]
pub mod violations;
