//! Hands the resolved kube-runtime version (read from this crate's
//! Cargo.lock) to the binary, which prints it beside its figures.

fn main() {
    let lock = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("Cargo.lock");
    println!("cargo::rerun-if-changed={}", lock.display());
    let text = std::fs::read_to_string(&lock).unwrap_or_default();
    let mut lines = text.lines();
    let mut version = String::from("unknown");
    while let Some(line) = lines.next() {
        if line.trim() == "name = \"kube-runtime\"" {
            if let Some(v) = lines
                .next()
                .and_then(|l| l.trim().strip_prefix("version = \""))
                .and_then(|v| v.strip_suffix('"'))
            {
                version = v.to_string();
            }
            break;
        }
    }
    println!("cargo::rustc-env=PEER_KUBE_RUNTIME_VERSION={version}");
}
