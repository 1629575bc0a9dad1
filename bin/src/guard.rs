//! Guard rails: what a shape would change, said before it changes anything,
//! and a question when the change destroys, replaces or spends a lot.

use crate::term::confirm;
use crate::words::{change_word, nodes};
use anyhow::{Result, bail};
use swactor_provisioning::{Change, ClusterShape, JournalImage, LogicalNodeId, ShapeDiff};

/// A shape that adds more nodes than this at once is confirmed first, like
/// one that destroys or replaces any: it is where a typo in `count` costs money.
pub(crate) const ASK_ABOVE_NEW_NODES: u64 = 20;

/// How many changed nodes `plan`, `apply` and `up` list by default.
pub(crate) const CHANGES_SHOWN: usize = 20;

/// `plan: 2 to create, 0 to replace, 1 to destroy, 3 unchanged`.
pub(crate) fn summary(diff: &ShapeDiff) -> String {
    format!(
        "plan: {} to create, {} to replace, {} to destroy, {} unchanged",
        diff.create, diff.replace, diff.destroy, diff.unchanged
    )
}

/// One line per listed change (`  destroy  worker-4`), then how many are not
/// listed, if any.
pub(crate) fn listing(changes: &[(LogicalNodeId, Change)], total: u64) -> Vec<String> {
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
pub(crate) fn reason_to_ask(diff: &ShapeDiff) -> Option<String> {
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
pub(crate) async fn ask(diff: &ShapeDiff, yes: bool) -> Result<()> {
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
/// fresh state directory), worked out before any daemon starts.
///
/// A slot's record names the template digest its attempt was made from; a
/// slot the new shape wants with another template is replaced, one it does
/// not want is destroyed (unless the journal's own shape no longer wanted it
/// either, so it was being removed already), and a wanted slot with no
/// record is created. It can differ from what the daemon then finds (an
/// agent that died since is replaced anyway), never by what the shape causes.
pub(crate) fn diff_from_journal(image: Option<&JournalImage>, shape: &ClusterShape) -> ShapeDiff {
    let mut diff = ShapeDiff::default();
    let Ok(next) = shape.validate() else {
        // Checked before this is called; an invalid shape changes nothing.
        return diff;
    };
    let note = |diff: &mut ShapeDiff, node: LogicalNodeId, change: Change| {
        match change {
            Change::Create => diff.create += 1,
            Change::Replace => diff.replace += 1,
            Change::Destroy => diff.destroy += 1,
        }
        if diff.examples.len() < ShapeDiff::EXAMPLES_MAX {
            diff.examples.push((node, change));
        }
    };
    let Some(image) = image else {
        for spec in next.specs() {
            note(&mut diff, spec.node, Change::Create);
        }
        return diff;
    };
    let previous = image.meta.shape.as_ref().and_then(|s| s.validate().ok());
    let mut changes: Vec<(LogicalNodeId, Change)> = Vec::new();
    for (id, record) in &image.slots {
        match next.slot(id) {
            Some(t) if t.digest() != record.template => changes.push((id.clone(), Change::Replace)),
            Some(_) => diff.unchanged += 1,
            None if previous.as_ref().is_some_and(|p| p.slot(id).is_some())
                && !image.meta.tearing_down =>
            {
                changes.push((id.clone(), Change::Destroy));
            }
            None => {}
        }
    }
    for spec in next.specs() {
        if !image.slots.contains_key(&spec.node) {
            changes.push((spec.node, Change::Create));
        }
    }
    // Slot order, as the daemon lists them.
    changes.sort_by(|a, b| a.0.cmp(&b.0));
    for (node, change) in changes {
        note(&mut diff, node, change);
    }
    diff
}

/// The listed changes of `diff`, as names and changes, at most `limit`.
pub(crate) fn examples(diff: &ShapeDiff, limit: usize) -> Vec<(LogicalNodeId, Change)> {
    diff.examples.iter().take(limit).cloned().collect()
}

/// Changed nodes in all.
pub(crate) fn changed(diff: &ShapeDiff) -> u64 {
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
