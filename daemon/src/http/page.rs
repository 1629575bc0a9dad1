//! The dashboard page: rendered here with the cluster as it is, then kept
//! live by a small script (`dashboard.js`) from the daemon's event stream.

use serde_json::Value;

/// The page's script, embedded in the binary.
pub(super) const SCRIPT: &str = include_str!("dashboard.js");

/// The page's frame, embedded in the binary; `<!--…-->` markers are filled in.
const TEMPLATE: &str = include_str!("dashboard.html");

/// Escapes text for HTML.
fn esc(text: &str) -> String {
    let mut out = String::with_capacity(text.len());
    for c in text.chars() {
        match c {
            '&' => out.push_str("&amp;"),
            '<' => out.push_str("&lt;"),
            '>' => out.push_str("&gt;"),
            '"' => out.push_str("&quot;"),
            '\'' => out.push_str("&#39;"),
            c => out.push(c),
        }
    }
    out
}

fn text(v: &Value) -> String {
    match v {
        Value::String(s) => s.clone(),
        Value::Null => String::new(),
        other => other.to_string(),
    }
}

/// The whole page for `overview` (`{"status": …, "groups": […]}`).
pub(super) fn render(overview: &Value) -> String {
    let status = &overview["status"];
    let run = text(&status["run_id"]);
    let generation = text(&status["generation"]);
    let mut groups = String::new();
    for g in overview["groups"].as_array().into_iter().flatten() {
        let id = esc(&text(&g["id"]));
        groups.push_str(&format!(
            "<tr data-group=\"{id}\"><td>{id}</td><td class=\"num\"><span class=\"ready\">{}</span> / \
             <span class=\"desired\">{}</span></td><td><input type=\"number\" min=\"0\" \
             id=\"count-{id}\" value=\"{}\"> <button data-scale=\"{id}\">Scale</button></td></tr>\n",
            text(&g["ready"]),
            text(&g["desired"]),
            text(&g["desired"]),
        ));
    }
    let mut nodes = String::new();
    for n in status["nodes"].as_array().into_iter().flatten() {
        let id = esc(&text(&n["node"]));
        let ready = n["ready"].as_bool().unwrap_or(false);
        nodes.push_str(&format!(
            "<tr id=\"node-{id}\" data-ready=\"{ready}\"><td><a href=\"#\" data-node=\"{id}\">{id}</a></td>\
             <td>{}</td><td>{}</td><td>a{}</td><td>{}</td><td class=\"num\">{}</td><td>{}</td>\
             <td></td><td></td><td><button data-replace=\"{id}\">Replace</button></td></tr>\n",
            if ready { "ready" } else { "not ready" },
            esc(&text(&n["stage"])),
            text(&n["attempt"]),
            esc(&text(&n["resource"])),
            text(&n["failures"]),
            esc(&text(&n["last_error"])),
        ));
    }
    // The script starts from the same data. A `<` can only be inside a JSON
    // string, where `\u003c` means the same and cannot end the element.
    let initial = overview.to_string().replace('<', "\\u003c");
    // Who leads, when several daemons share the run (the script keeps it
    // current); an empty line otherwise, hidden.
    let leader = esc(&text(&overview["leader"]));
    let leader_hidden = if leader.is_empty() { " hidden" } else { "" };
    TEMPLATE
        .replace("<!--RUN-->", &esc(&run))
        .replace("<!--LEADER-->", &leader)
        .replace("<!--LEADER-HIDDEN-->", leader_hidden)
        .replace("<!--GENERATION-->", &esc(&generation))
        .replace("<!--GROUPS-->", &groups)
        .replace("<!--NODES-->", &nodes)
        .replace("<!--INITIAL-->", &initial)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hostile_node_errors_are_escaped_and_cannot_end_the_script() {
        let overview = serde_json::json!({
            "status": {
                "run_id": "r<script>",
                "generation": 1,
                "nodes": [{"node": "w-0", "ready": false, "stage": "Failed", "attempt": 1,
                           "failures": 1, "last_error": "</script><script>alert(1)</script>"}]
            },
            "groups": [{"id": "w", "ready": 0, "desired": 1}]
        });
        let page = render(&overview);
        assert!(!page.contains("<script>alert"), "{page}");
        assert!(!page.contains("r<script>"));
        assert_eq!(
            page.matches("</script>").count(),
            TEMPLATE.matches("</script>").count()
        );
    }

    #[test]
    fn the_leader_line_shows_only_when_daemons_share_the_run() {
        let overview = |leader: Option<&str>| {
            let mut o = serde_json::json!({
                "status": {"run_id": "r", "generation": 1, "nodes": []},
                "groups": []
            });
            if let Some(l) = leader {
                o["leader"] = Value::String(l.to_owned());
            }
            o
        };
        let alone = render(&overview(None));
        assert!(
            alone.contains("<div id=\"leader\" class=\"note\" hidden></div>"),
            "{alone}"
        );
        let shared = render(&overview(Some(
            "leader: ctl-<b> (pid 1) · standbys: none — nothing takes over",
        )));
        assert!(
            shared.contains(
                "<div id=\"leader\" class=\"note\">leader: ctl-&lt;b&gt; (pid 1) · standbys: \
                 none — nothing takes over</div>"
            ),
            "{shared}"
        );
        assert!(!shared.contains("<!--LEADER"));
    }
}
