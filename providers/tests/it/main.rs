//! The crate's integration tests, gathered into one binary so that they
//! link once and share the test threads.

#[cfg(feature = "docker")]
mod docker;
mod process;
#[cfg(all(feature = "ssh", feature = "ssh-testing"))]
mod ssh;
#[cfg(all(feature = "ssh", feature = "ssh-testing"))]
mod ssh_hosts;
