//! The checkpoint reader on untrusted bytes: a checkpoint directory may come from anywhere
//! (a shared filesystem, a download, a disk that failed). Arbitrary or mutated manifests and
//! shard files whose checksum matches (so the safetensors parser runs) must end in an error
//! naming the file, never a panic.

// Lists of element ranges with a single range in them are meant: one piece of the vector.
#![allow(clippy::single_range_in_vec_init)]

use proptest::prelude::*;
use sha2::{Digest, Sha256};
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use wiretrain::checkpoint::{
    Checkpoint, FORMAT, FileEntry, LayoutEntry, Manifest, ScalarValue, ShardData, write_manifest,
    write_shard,
};

fn tmp(tag: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!(
        "wiretrain-ckfuzz-{}-{tag}-{:x}",
        std::process::id(),
        rand::random::<u64>()
    ));
    std::fs::create_dir_all(&d).unwrap();
    d
}

/// A valid 2-file checkpoint of 10 elements in `dir` (its manifest is returned).
fn valid(dir: &Path) -> Manifest {
    let files: Vec<FileEntry> = [0..6usize, 6..10]
        .into_iter()
        .enumerate()
        .map(|(rank, r)| {
            let shard = ShardData {
                ranges: vec![r.clone()],
                params: r.clone().map(|i| i as f32).collect(),
                state: vec![("m".into(), r.map(|i| -(i as f32)).collect())],
            };
            write_shard(dir, rank, &shard).unwrap()
        })
        .collect();
    let m = Manifest {
        format: FORMAT.into(),
        step: 3,
        strategy: "zero2".into(),
        world: 2,
        ranks_per_node: vec![1, 1],
        total: 10,
        layout: vec![LayoutEntry {
            path: "w".into(),
            shape: vec![2, 5],
            offset: 0,
            len: 10,
        }],
        optim_kind: "adamw".into(),
        state_tensors: vec!["m".into()],
        optim_scalars: BTreeMap::from([("time".into(), ScalarValue::UInt(3))]),
        run: serde_json::json!({}),
        files,
        run_id: "fuzz".into(),
        diloco: None,
        buffers: None,
    };
    write_manifest(dir, &m).unwrap();
    m
}

/// Opens `dir` and, if the manifest passes, reads every element: Ok or Err, never a panic.
fn read_all(dir: &Path) -> Result<(), String> {
    let ck = Checkpoint::open(dir).map_err(|e| e.to_string())?;
    let total = ck.manifest.total;
    // Never ask for more than a small model's worth: a manifest may claim anything.
    if total > 1 << 20 {
        return Err("too large to read here".into());
    }
    ck.read_ranges(&[0..total]).map_err(|e| e.to_string())?;
    ck.read_params().map_err(|e| e.to_string())?;
    Ok(())
}

#[test]
fn the_valid_checkpoint_reads_back() {
    let d = tmp("valid");
    valid(&d);
    let ck = Checkpoint::open(&d).unwrap();
    let data = ck.read_ranges(&[2..8]).unwrap();
    assert_eq!(data.params, [2.0, 3.0, 4.0, 5.0, 6.0, 7.0]);
    assert_eq!(data.state[0].1, [-2.0, -3.0, -4.0, -5.0, -6.0, -7.0]);
    let _ = std::fs::remove_dir_all(&d);
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(300))]

    #[test]
    fn arbitrary_manifests_are_errors(data in proptest::collection::vec(any::<u8>(), 0..2048)) {
        let d = tmp("bytes");
        std::fs::write(d.join("manifest.json"), &data).unwrap();
        prop_assert!(read_all(&d).is_err());
        let _ = std::fs::remove_dir_all(&d);
    }

    #[test]
    fn mutated_manifests_never_panic(
        flips in proptest::collection::vec((any::<usize>(), any::<u8>()), 1..6),
        numbers in proptest::collection::vec((any::<usize>(), any::<u64>()), 0..4),
    ) {
        let d = tmp("mutated");
        valid(&d);
        let path = d.join("manifest.json");
        let mut text = std::fs::read(&path).unwrap();
        // Replace some numbers by arbitrary ones (ranges, sizes, offsets, shapes) ...
        let mut s = String::from_utf8(text.clone()).unwrap();
        for (at, v) in numbers {
            let digits: Vec<(usize, usize)> = s
                .char_indices()
                .filter(|(_, c)| c.is_ascii_digit())
                .map(|(i, _)| (i, i + 1))
                .collect();
            if let Some(&(i, j)) = digits.get(at % digits.len().max(1)) {
                s.replace_range(i..j, &v.to_string());
            }
        }
        text = s.into_bytes();
        // ... and flip some bytes.
        for (at, b) in flips {
            let n = text.len();
            text[at % n] ^= b;
        }
        std::fs::write(&path, &text).unwrap();
        let _ = read_all(&d);
        let _ = std::fs::remove_dir_all(&d);
    }

    #[test]
    fn shards_whose_checksum_matches_but_bytes_are_garbage_are_errors(
        data in proptest::collection::vec(any::<u8>(), 0..512),
        header in proptest::option::of(0u64..4096),
    ) {
        let d = tmp("shard");
        let mut m = valid(&d);
        // A safetensors-looking prefix (a header length) or none, then arbitrary bytes.
        let mut bytes = header.map(|h| h.to_le_bytes().to_vec()).unwrap_or_default();
        bytes.extend_from_slice(&data);
        std::fs::write(d.join(&m.files[1].name), &bytes).unwrap();
        m.files[1].bytes = bytes.len() as u64;
        m.files[1].sha256 = Sha256::digest(&bytes).iter().map(|b| format!("{b:02x}")).collect();
        write_manifest(&d, &m).unwrap();
        let r = read_all(&d);
        prop_assert!(r.is_err(), "garbage loaded: {:?}", r);
        prop_assert!(r.unwrap_err().contains("shard-00001"));
        let _ = std::fs::remove_dir_all(&d);
    }
}
