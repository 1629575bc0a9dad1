//! The terminal: its size, tables that fit it, and asking before acting.

use anyhow::{Context, Result, bail};
use std::io::{BufRead, IsTerminal, Write};

/// Columns and rows of the terminal `fd` is, or `None` when it is not one.
fn size_of(fd: impl std::os::fd::AsFd + IsTerminal) -> Option<(usize, usize)> {
    if !fd.is_terminal() {
        return None;
    }
    let ws = rustix::termios::tcgetwinsize(fd).ok()?;
    (ws.ws_col > 0 && ws.ws_row > 0).then(|| (usize::from(ws.ws_col), usize::from(ws.ws_row)))
}

/// Columns and rows of the terminal on stderr, if it is one.
pub fn stderr_size() -> Option<(usize, usize)> {
    size_of(std::io::stderr())
}

/// Columns of the terminal on stdout, if it is one.
pub fn stdout_width() -> Option<usize> {
    size_of(std::io::stdout()).map(|(cols, _)| cols)
}

/// Whether standard output's reader has gone (see [`Stdout`]).
static STDOUT_CLOSED: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);

/// Standard output, for which a reader that went away (`| head -1`: EPIPE)
/// ends what is shown and nothing else: what is written from then on is
/// dropped, so a command goes on as it would have (an `apply` applies, a
/// refusal is refused) and its exit code says how it went, not that
/// nobody read the end of its output.
pub struct Stdout;

impl Stdout {
    /// Whether the reader has gone.
    pub fn closed() -> bool {
        STDOUT_CLOSED.load(std::sync::atomic::Ordering::Relaxed)
    }

    fn quiet(result: std::io::Result<()>) -> std::io::Result<()> {
        match result {
            Err(e) if e.kind() == std::io::ErrorKind::BrokenPipe => {
                STDOUT_CLOSED.store(true, std::sync::atomic::Ordering::Relaxed);
                Ok(())
            }
            other => other,
        }
    }
}

impl Write for Stdout {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        if !Self::closed() {
            // Whole or not at all, and flushed at once: a line written is
            // on its way to the reader (std's stdout holds partial lines).
            let mut out = std::io::stdout().lock();
            Self::quiet(out.write_all(buf).and_then(|()| out.flush()))?;
        }
        Ok(buf.len())
    }

    fn flush(&mut self) -> std::io::Result<()> {
        if Self::closed() {
            return Ok(());
        }
        Self::quiet(std::io::stdout().lock().flush())
    }
}

/// Narrowest room given to the last (free-text) column before it moves to
/// lines of its own below the row.
const LAST_COLUMN_MIN_CHARS: usize = 24;

/// A table whose last column is free text (a reason, an error), laid out for
/// a terminal `width` columns wide (`None`: no terminal, nothing is cut or
/// wrapped). Fixed columns are padded to their widest cell; the free text is
/// wrapped, never cut, so every line fits and none wraps on its own.
pub struct Table {
    header: Vec<&'static str>,
    rows: Vec<(Vec<String>, String)>,
}

impl Table {
    /// A table with these column titles (the last one titles the free text).
    pub fn new(header: &[&'static str]) -> Self {
        Self {
            header: header.to_vec(),
            rows: Vec::new(),
        }
    }

    /// Adds a row: the fixed cells, then the free text.
    pub fn row(&mut self, cells: Vec<String>, text: String) {
        self.rows.push((cells, text));
    }

    /// The lines of the table, header first, each row's lines together.
    pub fn render(&self, width: Option<usize>) -> Vec<Vec<String>> {
        let fixed = self.header.len().saturating_sub(1);
        let mut widths: Vec<usize> = self.header[..fixed].iter().map(|h| h.len()).collect();
        for (cells, _) in &self.rows {
            for (w, c) in widths.iter_mut().zip(cells) {
                *w = (*w).max(c.chars().count());
            }
        }
        let lead = |cells: &[String]| {
            let mut line = String::from("  ");
            for (w, c) in widths.iter().zip(cells) {
                line.push_str(c);
                line.extend(std::iter::repeat_n(' ', w - c.chars().count() + 2));
            }
            line
        };
        let indent = 2 + widths.iter().map(|w| w + 2).sum::<usize>();
        let header: Vec<String> = self.header[..fixed]
            .iter()
            .map(|h| (*h).to_owned())
            .collect();
        let title = self.header.last().copied().unwrap_or_default();
        let mut out = vec![fit(
            vec![format!("{}{title}", lead(&header)).trim_end().to_owned()],
            width,
        )];
        for (cells, text) in &self.rows {
            let head = lead(cells);
            let lines = match width {
                None => vec![format!("{head}{text}").trim_end().to_owned()],
                Some(w) if w >= indent + LAST_COLUMN_MIN_CHARS => {
                    let mut lines = Vec::new();
                    for (i, part) in wrap(text, w - indent).into_iter().enumerate() {
                        let pad = if i == 0 {
                            head.clone()
                        } else {
                            " ".repeat(indent)
                        };
                        lines.push(format!("{pad}{part}").trim_end().to_owned());
                    }
                    if lines.is_empty() {
                        lines.push(head.trim_end().to_owned());
                    }
                    lines
                }
                // Too narrow for the text beside the cells: it goes below them.
                Some(w) => {
                    let mut lines = fit(vec![head.trim_end().to_owned()], Some(w));
                    lines.extend(
                        wrap(text, w.saturating_sub(4))
                            .into_iter()
                            .map(|p| format!("    {p}")),
                    );
                    lines
                }
            };
            out.push(lines);
        }
        out
    }
}

/// Lines cut to `width` characters (only the fixed columns of a table on a
/// terminal narrower than they are ever need it).
fn fit(lines: Vec<String>, width: Option<usize>) -> Vec<String> {
    match width {
        None => lines,
        Some(w) => lines
            .into_iter()
            .map(|l| l.chars().take(w).collect())
            .collect(),
    }
}

/// `text` in lines of at most `width` characters, broken between words where
/// it can be and inside a word longer than a line. Nothing is dropped.
pub fn wrap(text: &str, width: usize) -> Vec<String> {
    let width = width.max(1);
    let mut lines = Vec::new();
    for paragraph in text.lines() {
        let mut line = String::new();
        let mut len = 0;
        for word in paragraph.split_whitespace() {
            let mut word: Vec<char> = word.chars().collect();
            let gap = usize::from(len > 0);
            if len + gap + word.len() <= width {
                if gap == 1 {
                    line.push(' ');
                }
                line.extend(&word);
                len += gap + word.len();
                continue;
            }
            if len > 0 {
                lines.push(std::mem::take(&mut line));
            }
            while word.len() > width {
                let rest = word.split_off(width);
                lines.push(word.iter().collect());
                word = rest;
            }
            line.extend(&word);
            len = word.len();
        }
        if len > 0 {
            lines.push(line);
        }
    }
    lines
}

/// Asks `question` on the terminal and waits for an answer: true for `y` or
/// `yes`. Refuses at once when stdin is not a terminal, naming `--yes`.
///
/// # Errors
/// Stdin is not a terminal, or it could not be read.
pub async fn confirm(question: String) -> Result<bool> {
    if !std::io::stdin().is_terminal() {
        bail!(
            "this needs a confirmation and stdin is not a terminal; pass --yes to go ahead \
             without being asked. Nothing was changed"
        );
    }
    tokio::task::spawn_blocking(move || {
        let mut err = std::io::stderr().lock();
        write!(err, "{question} [y/N] ")?;
        err.flush()?;
        drop(err);
        let mut answer = String::new();
        std::io::stdin().lock().read_line(&mut answer)?;
        let answer = answer.trim().to_ascii_lowercase();
        Ok::<_, std::io::Error>(answer == "y" || answer == "yes")
    })
    .await
    .context("reading the answer")?
    .context("reading the answer")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn wrapping_keeps_every_character_and_fits_the_width() {
        let text = "boot check `false` exited with status 1 after 0.1 s; see agent.log \
                    averyveryverylongwordthatcannotfitonalineofitsown";
        let lines = wrap(text, 20);
        assert!(lines.iter().all(|l| l.chars().count() <= 20), "{lines:?}");
        let joined: String = lines.concat();
        let squeezed: String = text.split_whitespace().collect();
        assert_eq!(joined.replace(' ', ""), squeezed);
    }

    #[test]
    fn a_table_fits_its_terminal_and_never_cuts_the_reason() {
        let mut t = Table::new(&["NODE", "STATE", "LAST ERROR"]);
        let reason = "the boot check failed: `false` exited with status 1 (see the agent's log)";
        t.row(vec!["worker-1".into(), "failed".into()], reason.into());
        t.row(vec!["worker-22".into(), "ready".into()], String::new());
        let rows = t.render(Some(50));
        assert!(
            rows.iter().flatten().all(|l| l.chars().count() <= 50),
            "{rows:?}"
        );
        let text: String = rows[1]
            .iter()
            .map(|l| l.trim())
            .collect::<Vec<_>>()
            .join(" ");
        assert!(text.ends_with(reason), "{text}");
        assert_eq!(rows[2], vec!["  worker-22  ready".to_owned()]);
        // Without a terminal, one line per row, whole.
        let plain = t.render(None);
        assert_eq!(plain[1].len(), 1);
        assert!(plain[1][0].ends_with(reason));
        // Narrower than the fixed columns: the reason goes below, still whole.
        let narrow = t.render(Some(24));
        assert!(
            narrow.iter().flatten().all(|l| l.chars().count() <= 24),
            "{narrow:?}"
        );
        let text: String = narrow[1][1..]
            .iter()
            .map(|l| l.trim())
            .collect::<Vec<_>>()
            .join(" ");
        assert_eq!(text, reason);
    }
}
