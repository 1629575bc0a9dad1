//! The last few lines an agent wrote of its own, quoted when it ends unannounced.

use std::collections::VecDeque;

/// Lines of the agent's own output (not protocol lines) quoted.
const RECENT_LINES_MAX: usize = 5;
/// Characters kept of each quoted line.
const RECENT_LINE_CHARS_MAX: usize = 300;

/// A small ring of an agent's latest output lines, as plain text.
///
/// Every provider quotes it the same way in the reason of a lost agent, so
/// a user reads the same words whichever provider ran the node.
#[derive(Debug, Default)]
pub(crate) struct RecentOutput {
    lines: VecDeque<String>,
}

impl RecentOutput {
    /// Keeps `line` without terminal escapes and control characters, cut to
    /// a bounded length; a blank line is not kept.
    pub(crate) fn remember(&mut self, line: &str) {
        let plain = strip_escapes(line);
        let plain = plain.trim();
        if plain.is_empty() {
            return;
        }
        let mut kept: String = plain.chars().take(RECENT_LINE_CHARS_MAX).collect();
        if kept.len() < plain.len() {
            kept.push('…');
        }
        if self.lines.len() == RECENT_LINES_MAX {
            self.lines.pop_front();
        }
        self.lines.push_back(kept);
    }

    /// The clause that ends a lost agent's reason: what it last wrote, or
    /// that it wrote nothing.
    pub(crate) fn clause(&self) -> String {
        if self.lines.is_empty() {
            return " (it wrote nothing else)".to_owned();
        }
        let last: Vec<&str> = self.lines.iter().map(String::as_str).collect();
        format!("; its last output: {}", last.join(" | "))
    }
}

/// `line` without ANSI escape sequences (colours, cursor moves) and without
/// control characters other than tabs.
pub(crate) fn strip_escapes(line: &str) -> String {
    let mut out = String::with_capacity(line.len());
    let mut chars = line.chars().peekable();
    while let Some(c) = chars.next() {
        if c != '\u{1b}' {
            if !c.is_control() || c == '\t' {
                out.push(c);
            }
            continue;
        }
        // CSI: ESC [ parameters… final byte in @..~; other escapes: one more char.
        if chars.next_if_eq(&'[').is_some() {
            for c in chars.by_ref() {
                if ('@'..='~').contains(&c) {
                    break;
                }
            }
        } else {
            chars.next();
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn escapes_and_control_characters_are_stripped_from_quoted_output() {
        assert_eq!(
            strip_escapes("\u{1b}[2m2026\u{1b}[0m \u{1b}[31mERROR\u{1b}[0m boom\r"),
            "2026 ERROR boom"
        );
        assert_eq!(strip_escapes("plain\tline"), "plain\tline");
    }

    #[test]
    fn the_ring_keeps_the_last_lines_cut_and_quotes_them() {
        let mut recent = RecentOutput::default();
        assert_eq!(recent.clause(), " (it wrote nothing else)");
        recent.remember("  ");
        recent.remember("\u{1b}[31m\r");
        assert_eq!(recent.clause(), " (it wrote nothing else)");
        for i in 0..7 {
            recent.remember(&format!("line {i}"));
        }
        assert_eq!(
            recent.clause(),
            "; its last output: line 2 | line 3 | line 4 | line 5 | line 6"
        );
        recent.remember(&"x".repeat(400));
        let last = recent.lines.back().unwrap();
        assert_eq!(last.chars().count(), RECENT_LINE_CHARS_MAX + 1);
        assert!(last.ends_with('…'));
        assert_eq!(recent.lines.len(), RECENT_LINES_MAX);
    }
}
