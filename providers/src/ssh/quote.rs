//! Building shell command lines that a remote POSIX shell splits back into the intended arguments.

/// `arg` as one word of a POSIX shell command line.
///
/// Words made only of characters no shell treats specially
/// (`A-Z a-z 0-9 _ - . , / : @ % +`) stay as they are; anything else is
/// wrapped in single quotes, inside which a shell interprets nothing, with
/// each `'` written as `'\''`. The empty string becomes `''`. A word with
/// `=` is quoted too: unquoted, it would be a variable assignment in the
/// command position (and a path lookup at the start of a zsh word).
///
/// # Panics
/// When `arg` contains a NUL character, which no command line can carry
/// (the server would cut the command there and run something else).
pub fn quote(arg: &str) -> String {
    assert!(
        !arg.contains('\0'),
        "a shell argument cannot contain a NUL character: {arg:?}"
    );
    let plain = |c: char| c.is_ascii_alphanumeric() || "_-.,/:@%+".contains(c);
    if !arg.is_empty() && arg.chars().all(plain) {
        return arg.to_owned();
    }
    let mut quoted = String::with_capacity(arg.len() + 2);
    quoted.push('\'');
    for c in arg.chars() {
        if c == '\'' {
            quoted.push_str("'\\''");
        } else {
            quoted.push(c);
        }
    }
    quoted.push('\'');
    quoted
}

/// The command line that runs `argv` (program first) with exactly these
/// arguments: each quoted with [`quote`], joined by spaces.
///
/// # Panics
/// When an argument contains a NUL character (see [`quote`]).
pub fn command_line(argv: &[String]) -> String {
    argv.iter()
        .map(|arg| quote(arg))
        .collect::<Vec<_>>()
        .join(" ")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn plain_words_stay_readable_and_everything_else_is_single_quoted() {
        assert_eq!(quote("ls"), "ls");
        assert_eq!(quote("/opt/swactor-1.0/bin"), "/opt/swactor-1.0/bin");
        assert_eq!(quote("--run"), "--run");
        assert_eq!(quote("A=b"), "'A=b'");
        assert_eq!(quote(""), "''");
        assert_eq!(quote("a b"), "'a b'");
        assert_eq!(quote("it's"), "'it'\\''s'");
        assert_eq!(quote("$(id)"), "'$(id)'");
        assert_eq!(quote("~"), "'~'");
        assert_eq!(quote("*"), "'*'");
        assert_eq!(quote("é"), "'é'");
        assert_eq!(
            command_line(&["echo".into(), "a b".into(), String::new()]),
            "echo 'a b' ''"
        );
    }

    #[test]
    #[should_panic(expected = "NUL")]
    fn a_nul_character_cannot_be_quoted() {
        let _ = quote("a\0b");
    }
}
