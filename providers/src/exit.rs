//! How a process ended: [`Ended`] (its words live in the core, where the
//! jobs core uses them too) read from a status this process waited for.

pub use swactor_provisioning::exit::{Ended, signal_name};

/// How a process this one waited for ended.
pub fn of(status: &std::process::ExitStatus) -> Ended {
    use std::os::unix::process::ExitStatusExt;
    Ended::new(status.code(), status.signal())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_real_status_is_read_as_the_kernel_gave_it() {
        let status = std::process::Command::new("sh")
            .args(["-c", "kill -TERM $$"])
            .status()
            .unwrap();
        assert_eq!(of(&status).to_string(), "killed by signal 15 (SIGTERM)");
        let status = std::process::Command::new("sh")
            .args(["-c", "exit 1"])
            .status()
            .unwrap();
        assert_eq!(of(&status).to_string(), "exited with code 1");
    }
}
