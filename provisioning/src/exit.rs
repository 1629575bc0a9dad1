//! How a process ended, in the same words wherever it is told: `exited with
//! code 1`, `killed by signal 15 (SIGTERM)`.
//!
//! A process has either an exit code or the signal that ended it. Where only
//! a shell's `$?` is known (a command run over SSH, a container's exit code),
//! a code above 128 that is 128 plus a known signal's number is told as that
//! signal, as the shell itself means it. A status waited for is read by
//! the crates that wait (`swactor_providers::exit::of`).

use std::fmt;

/// How a process ended.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Ended {
    /// It exited with this code.
    Code(i32),
    /// A signal (its number) ended it.
    Signal(i32),
    /// Nothing says how (it was not waited for, or the status was lost).
    Unknown,
}

impl Ended {
    /// From a code and a signal, as `std::os::unix::process::ExitStatusExt`
    /// gives them (the code wins when both are given).
    pub fn new(code: Option<i32>, signal: Option<i32>) -> Self {
        match (code, signal) {
            (Some(code), _) => Self::Code(code),
            (None, Some(signal)) => Self::Signal(signal),
            (None, None) => Self::Unknown,
        }
    }

    /// From a shell's `$?`: 128 + N for a known signal N is that signal.
    pub fn from_shell(code: i32) -> Self {
        match code.checked_sub(128) {
            Some(n) if signal_name(n).is_some() => Self::Signal(n),
            _ => Self::Code(code),
        }
    }

    /// From what an SSH server reports: an exit status, or the name of the
    /// signal that ended the command (`TERM`, without `SIG`).
    pub fn from_ssh(status: Option<u32>, signal: Option<&str>) -> Self {
        match (status, signal) {
            (Some(s), _) => i32::try_from(s).map_or(Self::Unknown, Self::Code),
            (None, Some(name)) => signal_number(name).map_or(Self::Unknown, Self::Signal),
            (None, None) => Self::Unknown,
        }
    }

    /// The words with a subject before them: `the agent exited with code 1`,
    /// `the agent was killed by signal 9 (SIGKILL)`.
    pub fn clause(self) -> String {
        match self {
            Self::Signal(_) => format!("was {self}"),
            _ => self.to_string(),
        }
    }
}

impl fmt::Display for Ended {
    /// `exited with code 1`, `killed by signal 15 (SIGTERM)`, `ended
    /// without an exit status`.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match *self {
            Self::Code(code) => write!(f, "exited with code {code}"),
            Self::Signal(n) => match signal_name(n) {
                Some(name) => write!(f, "killed by signal {n} ({name})"),
                None => write!(f, "killed by signal {n}"),
            },
            Self::Unknown => write!(f, "ended without an exit status"),
        }
    }
}

/// Linux's signals, by number (`SIGTERM` is 15).
const SIGNALS: [&str; 31] = [
    "SIGHUP",
    "SIGINT",
    "SIGQUIT",
    "SIGILL",
    "SIGTRAP",
    "SIGABRT",
    "SIGBUS",
    "SIGFPE",
    "SIGKILL",
    "SIGUSR1",
    "SIGSEGV",
    "SIGUSR2",
    "SIGPIPE",
    "SIGALRM",
    "SIGTERM",
    "SIGSTKFLT",
    "SIGCHLD",
    "SIGCONT",
    "SIGSTOP",
    "SIGTSTP",
    "SIGTTIN",
    "SIGTTOU",
    "SIGURG",
    "SIGXCPU",
    "SIGXFSZ",
    "SIGVTALRM",
    "SIGPROF",
    "SIGWINCH",
    "SIGIO",
    "SIGPWR",
    "SIGSYS",
];

/// `SIGTERM` for 15; `None` for a number that is no signal's.
pub fn signal_name(n: i32) -> Option<&'static str> {
    let i = usize::try_from(n.checked_sub(1)?).ok()?;
    SIGNALS.get(i).copied()
}

/// 15 for `TERM` or `SIGTERM`.
fn signal_number(name: &str) -> Option<i32> {
    let name = name.strip_prefix("SIG").unwrap_or(name);
    let i = SIGNALS.iter().position(|s| s[3..] == *name)?;
    i32::try_from(i + 1).ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_end_is_told_as_a_code_or_a_named_signal() {
        assert_eq!(Ended::new(Some(1), None).to_string(), "exited with code 1");
        assert_eq!(
            Ended::new(None, Some(15)).to_string(),
            "killed by signal 15 (SIGTERM)"
        );
        assert_eq!(
            Ended::new(None, Some(64)).to_string(),
            "killed by signal 64"
        );
        assert_eq!(
            Ended::new(None, None).to_string(),
            "ended without an exit status"
        );
        assert_eq!(
            Ended::Signal(9).clause(),
            "was killed by signal 9 (SIGKILL)"
        );
        assert_eq!(Ended::Code(0).clause(), "exited with code 0");
    }

    #[test]
    fn a_shells_code_past_128_is_its_signal_and_ssh_names_its_signals() {
        assert_eq!(Ended::from_shell(143), Ended::Signal(15));
        assert_eq!(Ended::from_shell(137), Ended::Signal(9));
        assert_eq!(Ended::from_shell(3), Ended::Code(3));
        assert_eq!(Ended::from_shell(128), Ended::Code(128));
        assert_eq!(Ended::from_shell(255), Ended::Code(255));
        assert_eq!(Ended::from_ssh(Some(2), None), Ended::Code(2));
        assert_eq!(Ended::from_ssh(None, Some("KILL")), Ended::Signal(9));
        assert_eq!(Ended::from_ssh(None, Some("SIGTERM")), Ended::Signal(15));
        assert_eq!(Ended::from_ssh(None, Some("NOPE")), Ended::Unknown);
    }
}
