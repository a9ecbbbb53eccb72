//! Peak resident memory of this process (Linux: `VmHWM` in `/proc/self/status`), and a reset
//! of that peak (`/proc/self/clear_refs`), so a run can report the peak of its training steps
//! apart from start-up. Elsewhere both report "unknown".

/// The process's peak resident set size in bytes since start (or the last reset).
pub fn peak_rss_bytes() -> Option<u64> {
    // procfs is Linux's; elsewhere a path like /proc/self/status means nothing (or, on
    // Windows, a file on the current drive).
    if !cfg!(target_os = "linux") {
        return None;
    }
    let status = std::fs::read_to_string("/proc/self/status").ok()?;
    let line = status.lines().find(|l| l.starts_with("VmHWM:"))?;
    let kb: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kb * 1024)
}

/// Resets the peak to the current resident size; false where that is not possible.
pub fn reset_peak_rss() -> bool {
    cfg!(target_os = "linux") && std::fs::write("/proc/self/clear_refs", "5").is_ok()
}

#[cfg(test)]
#[path = "../../tests/common/skip.rs"]
mod skip;

#[cfg(test)]
mod tests {
    use super::skip;
    use super::*;

    #[test]
    fn the_peak_follows_a_large_allocation_and_resets() {
        let Some(before) = peak_rss_bytes() else {
            return skip::skip_unless("no /proc/self/status here", !cfg!(target_os = "linux"));
        };
        let big = vec![1u8; 64 << 20];
        std::hint::black_box(&big);
        let during = peak_rss_bytes().unwrap();
        assert!(during >= before.max(64 << 20), "{before} -> {during}");
        drop(big);
        if reset_peak_rss() {
            let after = peak_rss_bytes().unwrap();
            assert!(after + (32 << 20) < during, "reset: {during} -> {after}");
        }
    }
}
