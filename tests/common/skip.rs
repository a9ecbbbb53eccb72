//! The one rule for a test whose prerequisite is missing (lavapipe, root, ip/tc, /proc, a
//! GPU): when `CI` is set (any value) the test fails, since CI must run every test; elsewhere
//! it skips loudly: "SKIPPED <test>: <why>" on stderr, and a line in the file
//! `WIRETRAIN_SKIP_LOG` names, which `scripts/test.sh` lists at the end of the run. Shared by
//! every test crate of the workspace (included with `#[path]`).

#![allow(dead_code)]

use std::io::Write;

/// A prerequisite of the calling test is missing (`why`): fails when `CI` is set, else skips
/// loudly; the caller then returns.
pub(crate) fn skip_unless_ci(why: &str) {
    skip_unless(why, false);
}

/// [`skip_unless_ci`], except that `allowed` lets the test skip under CI too (a prerequisite
/// CI cannot have, such as a GPU, when the run says so); the skip is still listed.
pub(crate) fn skip_unless(why: &str, allowed: bool) {
    let test = std::thread::current().name().unwrap_or("?").to_string();
    assert!(
        std::env::var_os("CI").is_none() || allowed,
        "CI is set, but {test} cannot run here: {why}"
    );
    eprintln!("SKIPPED {test}: {why}");
    if let Some(p) = std::env::var_os("WIRETRAIN_SKIP_LOG") {
        let line = format!("{test}: {}\n", why.replace('\n', " "));
        if let Ok(mut f) = std::fs::OpenOptions::new()
            .append(true)
            .create(true)
            .open(p)
        {
            let _ = f.write_all(line.as_bytes());
        }
    }
}
