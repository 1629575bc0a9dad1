//! Reading the wall clock.

/// Reads the wall clock.
pub fn run() -> bool {
    std::time::SystemTime::now() > std::time::UNIX_EPOCH // VIOLATION: std::time::SystemTime::now
}
