//! A named thread is still a thread.

/// Starts an OS thread.
pub fn run() {
    let _ = std::thread::Builder::new().spawn(|| {}); // VIOLATION: std::thread::Builder::spawn
}
