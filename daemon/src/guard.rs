//! Guard rails: what a shape would change, said before it changes anything,
//! and a question when the change destroys, replaces or spends a lot.

use crate::term::confirm;
use crate::words::{change_word, nodes};
use anyhow::{Result, bail};
use swactor_provisioning::{Change, ClusterShape, JournalImage, LogicalNodeId, ShapeDiff};

/// A shape that adds more nodes than this at once is confirmed first, like
/// one that destroys or replaces any: it is where a typo in `count` costs money.
pub const ASK_ABOVE_NEW_NODES: u64 = 20;

/// How many changed nodes `plan`, `apply` and `up` list by default.
pub const CHANGES_SHOWN: usize = 20;

/// `plan: 2 to create, 0 to replace, 1 to destroy, 3 unchanged`.
pub fn summary(diff: &ShapeDiff) -> String {
    format!(
        "plan: {} to create, {} to replace, {} to destroy, {} unchanged",
        diff.create, diff.replace, diff.destroy, diff.unchanged
    )
}

/// One line per listed change (`  destroy  worker-4`), then how many are not
/// listed, if any.
pub fn listing(changes: &[(LogicalNodeId, Change)], total: u64) -> Vec<String> {
    let mut lines: Vec<String> = changes
        .iter()
        .map(|(node, change)| format!("  {:<8} {node}", change_word(*change)))
        .collect();
    let more = total.saturating_sub(changes.len() as u64);
    if more > 0 {
        lines.push(format!(
            "  … and {more} more (`swactor plan --all SHAPE` lists every one)"
        ));
    }
    lines
}

/// Why a change needs a confirmation, or `None` when it does not.
pub fn reason_to_ask(diff: &ShapeDiff) -> Option<String> {
    let mut why = Vec::new();
    if diff.destroy > 0 {
        why.push(format!("destroys {}", nodes(diff.destroy)));
    }
    if diff.replace > 0 {
        why.push(format!("replaces {}", nodes(diff.replace)));
    }
    if diff.create > ASK_ABOVE_NEW_NODES {
        why.push(format!(
            "creates {} (more than {ASK_ABOVE_NEW_NODES} at once)",
            nodes(diff.create)
        ));
    }
    (!why.is_empty()).then(|| format!("this shape {}", why.join(" and ")))
}

/// Asks before a change that needs it, unless `yes`.
///
/// # Errors
/// The answer was no, or there is no terminal to ask on (the message names
/// `--yes`); nothing was changed.
pub async fn ask(diff: &ShapeDiff, yes: bool) -> Result<()> {
    let Some(why) = reason_to_ask(diff) else {
        return Ok(());
    };
    if yes {
        return Ok(());
    }
    if !std::io::IsTerminal::is_terminal(&std::io::stdin()) {
        bail!(
            "{why}, which needs a confirmation, and stdin is not a terminal to ask on; \
             pass --yes to go ahead. Nothing was changed"
        );
    }
    if confirm(format!("{why}. Go ahead?")).await? {
        Ok(())
    } else {
        bail!("not confirmed; nothing was changed")
    }
}

/// What `shape` would change on a cluster whose journal is `image` (none: a
/// fresh state directory), worked out before any daemon starts; the core
/// decides it (`JournalImage::diff`).
pub fn diff_from_journal(image: Option<&JournalImage>, shape: &ClusterShape) -> ShapeDiff {
    let Ok(next) = shape.validate() else {
        // Checked before this is called; an invalid shape changes nothing.
        return ShapeDiff::default();
    };
    match image {
        Some(image) => image.diff(&next),
        None => ShapeDiff::all_created(&next),
    }
}

/// The listed changes of `diff`, as names and changes, at most `limit`.
pub fn examples(diff: &ShapeDiff, limit: usize) -> Vec<(LogicalNodeId, Change)> {
    diff.examples.iter().take(limit).cloned().collect()
}

/// Changed nodes in all.
pub fn changed(diff: &ShapeDiff) -> u64 {
    diff.create + diff.replace + diff.destroy
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::shapefile::ShapeFile;
    use swactor_provisioning::{NodeAttemptId, SlotRecord};

    fn shape(body: &str) -> ClusterShape {
        ShapeFile::parse(body, "x").unwrap().check(1).unwrap()
    }

    fn workers(n: u32, check: &str) -> ClusterShape {
        shape(&format!(
            "run = \"r\"\n[[group]]\nid = \"worker\"\ncount = {n}\nprovider = \"process\"\nboot_check = [\"{check}\"]\n"
        ))
    }

    /// A journal holding `old`, each of its slots made from its template.
    fn journal_of(old: &ClusterShape) -> JournalImage {
        let mut image = JournalImage::new(old.run_id.clone());
        image.meta.shape = Some(old.clone());
        for (i, spec) in old.validate().unwrap().specs().enumerate() {
            image.slots.insert(
                spec.node,
                SlotRecord {
                    attempt: NodeAttemptId(i as u64 + 1),
                    template: spec.template.digest(),
                    created: true,
                    failures: 0,
                    replace: false,
                },
            );
        }
        image
    }

    #[test]
    fn a_fresh_state_directory_creates_every_node_and_a_small_shape_never_asks() {
        let d = diff_from_journal(None, &workers(4, "true"));
        assert_eq!((d.create, d.replace, d.destroy, d.unchanged), (4, 0, 0, 0));
        assert_eq!(reason_to_ask(&d), None);
        let big = diff_from_journal(None, &workers(ASK_ABOVE_NEW_NODES as u32 + 1, "true"));
        assert!(reason_to_ask(&big).unwrap().contains("creates 21 nodes"));
    }

    #[test]
    fn a_journal_tells_replacements_and_destructions_from_unchanged_nodes() {
        let old = journal_of(&workers(3, "true"));
        let same = diff_from_journal(Some(&old), &workers(3, "true"));
        assert_eq!(
            (same.create, same.replace, same.destroy, same.unchanged),
            (0, 0, 0, 3)
        );
        let fewer = diff_from_journal(Some(&old), &workers(1, "true"));
        assert_eq!((fewer.destroy, fewer.unchanged), (2, 1));
        assert_eq!(
            fewer.examples,
            vec![
                (LogicalNodeId::parse("worker-1").unwrap(), Change::Destroy),
                (LogicalNodeId::parse("worker-2").unwrap(), Change::Destroy)
            ]
        );
        assert!(reason_to_ask(&fewer).unwrap().contains("destroys 2 nodes"));
        let other = diff_from_journal(Some(&old), &workers(4, "/bin/true"));
        assert_eq!((other.create, other.replace, other.unchanged), (1, 3, 0));
        assert!(reason_to_ask(&other).unwrap().contains("replaces 3 nodes"));
    }

    #[test]
    fn a_listing_is_bounded_and_says_how_many_more_there_are() {
        let d = diff_from_journal(None, &workers(100, "true"));
        let lines = listing(&examples(&d, CHANGES_SHOWN), changed(&d));
        assert_eq!(lines.len(), CHANGES_SHOWN + 1);
        assert_eq!(lines[0], "  create   worker-0");
        assert!(lines[CHANGES_SHOWN].contains("80 more"), "{lines:?}");
        assert!(summary(&d).starts_with("plan: 100 to create, 0 to replace, 0 to destroy"));
    }
}
