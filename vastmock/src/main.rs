//! `swactor-vastmock`: the Vast.ai API mock as a process, for manual runs and non-Rust tests.
//!
//! `swactor-vastmock [--listen ADDR] [--api-key KEY] [--state-dir DIR]`
//! prints the base URL on its first stdout line and the API key on the
//! second (`api_key=KEY`), then serves until SIGINT or SIGTERM, when it
//! stops every instance's sshd. The default configuration is realistic
//! (Vast.ai's rate limits, a few seconds of boot); drive faults through
//! the `/admin/...` routes (see the crate documentation).

use std::io::Write;
use std::path::PathBuf;
use swactor_vastmock::{MockConfig, VastMock};

const USAGE: &str = "usage: swactor-vastmock [--listen ADDR] [--api-key KEY] [--state-dir DIR]";

fn main() {
    let mut config = MockConfig::default();
    let mut args = std::env::args().skip(1);
    while let Some(arg) = args.next() {
        let (flag, inline) = match arg.split_once('=') {
            Some((f, v)) => (f.to_owned(), Some(v.to_owned())),
            None => (arg.clone(), None),
        };
        if flag == "-h" || flag == "--help" {
            println!("{USAGE}");
            return;
        }
        let Some(value) = inline.or_else(|| args.next()) else {
            fail(&format!("{flag} needs a value"));
        };
        match flag.as_str() {
            "--listen" => match value.parse() {
                Ok(addr) => config.listen = addr,
                Err(e) => fail(&format!("bad --listen {value:?}: {e}")),
            },
            "--api-key" => config.api_key = Some(value),
            "--state-dir" => config.state_dir = Some(PathBuf::from(value)),
            _ => fail(&format!("unknown argument {flag:?}")),
        }
    }
    let mock = match VastMock::start(config) {
        Ok(mock) => mock,
        Err(e) => {
            let mut msg = e.to_string();
            let mut source = std::error::Error::source(&e);
            while let Some(s) = source {
                msg.push_str(&format!(": {s}"));
                source = s.source();
            }
            fail(&msg)
        }
    };
    let mut out = std::io::stdout().lock();
    let _ = writeln!(out, "{}", mock.url());
    let _ = writeln!(out, "api_key={}", mock.api_key());
    let _ = out.flush();
    drop(out);
    wait_for_signal();
    drop(mock);
}

fn wait_for_signal() {
    let runtime = match tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
    {
        Ok(rt) => rt,
        Err(e) => fail(&format!("cannot wait for signals: {e}")),
    };
    runtime.block_on(async {
        use tokio::signal::unix::{SignalKind, signal};
        let mut term = match signal(SignalKind::terminate()) {
            Ok(s) => s,
            Err(e) => fail(&format!("cannot wait for SIGTERM: {e}")),
        };
        tokio::select! {
            _ = tokio::signal::ctrl_c() => {}
            _ = term.recv() => {}
        }
    });
}

fn fail(msg: &str) -> ! {
    eprintln!("swactor-vastmock: {msg}\n{USAGE}");
    std::process::exit(2);
}
