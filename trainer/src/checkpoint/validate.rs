//! The checks of a manifest read from disk: known format, plain file names, ranges inside the
//! model covering it exactly once, sizes that fit what the files must hold.

use super::{FORMAT, FileEntry, LayoutEntry, MANIFEST, Manifest};

/// Checks a manifest read from disk: known format, sane names, layout and file ranges that
/// cover the flat vector exactly once.
pub(super) fn validate(m: &Manifest) -> Result<(), String> {
    if m.format != FORMAT {
        return Err(format!("format {:?}, expected {FORMAT:?}", m.format));
    }
    let ranks = m
        .ranks_per_node
        .iter()
        .try_fold(0usize, |a, &r| a.checked_add(r));
    if m.world == 0 || ranks != Some(m.world) {
        return Err(format!(
            "world {} does not match ranks per node {:?}",
            m.world, m.ranks_per_node
        ));
    }
    check_layout("parameter", &m.layout, m.total)?;
    check_cover("", &m.files, m.total, m.state_tensors.len())?;
    if let Some(d) = &m.diloco {
        check_file(&d.outer, 1)?;
        if d.outer.ranges != [[0, m.total]] {
            return Err(format!(
                "diloco outer file {}: ranges {:?}, expected the whole vector [[0, {}]]",
                d.outer.name, d.outer.ranges, m.total
            ));
        }
        if d.nodes.len() + 1 != m.ranks_per_node.len() {
            return Err(format!(
                "diloco: inner state of {} nodes for {} nodes",
                d.nodes.len() + 1,
                m.ranks_per_node.len()
            ));
        }
        for (i, files) in d.nodes.iter().enumerate() {
            let what = format!("diloco node {}: ", i + 1);
            check_cover(&what, files, m.total, m.state_tensors.len())?;
        }
    }
    if let Some(b) = &m.buffers {
        check_layout("module state", &b.layout, b.total)?;
        check_file(&b.file, 0)?;
        if b.file.ranges != [[0, b.total]] {
            return Err(format!(
                "module state file {}: ranges {:?}, expected the whole state [[0, {}]]",
                b.file.name, b.file.ranges, b.total
            ));
        }
    }
    if m.state_tensors
        .iter()
        .any(|s| s.is_empty() || s.len() > 200)
    {
        return Err("bad optimizer state tensor name".into());
    }
    Ok(())
}

/// Checks that `layout`'s entries follow one another from 0 to `total`, each as long as its
/// shape (checked arithmetic: a crafted shape is refused, not an overflow).
fn check_layout(what: &str, layout: &[LayoutEntry], total: usize) -> Result<(), String> {
    let mut at = 0usize;
    for e in layout {
        let prod = e
            .shape
            .iter()
            .try_fold(1usize, |a, &d| a.checked_mul(d))
            .ok_or_else(|| format!("{what} {:?}: shape overflows", e.path))?;
        if e.offset != at || e.len != prod {
            return Err(format!(
                "{what} {:?}: offset {} / len {} do not follow the layout",
                e.path, e.offset, e.len
            ));
        }
        at = at
            .checked_add(e.len)
            .ok_or_else(|| format!("{what} layout size overflows"))?;
    }
    if at != total {
        return Err(format!(
            "{what} layout holds {at} elements, total says {total}"
        ));
    }
    Ok(())
}

/// Checks every file of a set and that their ranges cover `0..total` exactly once.
pub(super) fn check_cover(
    what: &str,
    files: &[FileEntry],
    total: usize,
    state_tensors: usize,
) -> Result<(), String> {
    let mut all: Vec<[usize; 2]> = Vec::new();
    for f in files {
        check_file(f, state_tensors)?;
        all.extend(f.ranges.iter().copied());
    }
    all.sort();
    let mut at = 0;
    for r in &all {
        if r[0] > r[1] || r[1] > total {
            return Err(format!("{what}range {r:?} is outside 0..{total}"));
        }
        if r[0] != at {
            return Err(if r[0] < at {
                format!("{what}element {} is stored twice", r[0])
            } else {
                format!("{what}elements {at}..{} are in no file", r[0])
            });
        }
        at = r[1];
    }
    if at != total {
        return Err(format!("{what}elements {at}..{total} are in no file"));
    }
    Ok(())
}

/// A file entry's name, checksum and size claims, before anything is read.
pub(super) fn check_file(f: &FileEntry, state_tensors: usize) -> Result<(), String> {
    let plain = !f.name.is_empty()
        && f.name
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | '.'))
        && !f.name.starts_with('.')
        && f.name != MANIFEST;
    if !plain {
        return Err(format!("file name {:?} is not a plain file name", f.name));
    }
    if f.sha256.len() != 64 || !f.sha256.chars().all(|c| c.is_ascii_hexdigit()) {
        return Err(format!("file {}: bad sha256 {:?}", f.name, f.sha256));
    }
    let n = f
        .ranges
        .iter()
        .try_fold(0usize, |a, r| a.checked_add(r[1].saturating_sub(r[0])))
        .ok_or_else(|| format!("file {}: its ranges overflow", f.name))?;
    // Data plus a small header; a file claiming more bytes than that is refused unread.
    let limit = (n as u64)
        .saturating_mul(4 * (1 + state_tensors as u64))
        .saturating_add(1 << 20);
    if f.bytes > limit {
        return Err(format!(
            "file {}: {} bytes is more than its {n} elements need",
            f.name, f.bytes
        ));
    }
    Ok(())
}
