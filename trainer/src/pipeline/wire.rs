//! An [`Act`] as two messages between stages: a fixed-size header that describes its tensors
//! (kind, rank, dimensions; what the receiver needs to post the second receive and rebuild
//! the tensors) and the elements of all of them, as f32. Integer tensors (token ids, masks)
//! travel as f32 too, exactly while they stay within ±2^24; larger ones are refused. An
//! activation is one tensor or a flat tuple of at least two (a nested or one-element tuple is
//! refused: it would arrive flattened). A header no stage writes is refused before anything is
//! allocated for it.

use super::PipelineError;
use crate::transfer;
use crate::units::Act;
use burn::tensor::{Device, Int, Tensor, TensorData};

/// Tensors one activation may hold (a tuple's leaves).
pub const MAX_LEAVES: usize = 8;
/// The header's length in f32: the leaf count, then per leaf its kind, rank and 4 dims.
pub const HEADER_LEN: usize = 1 + 6 * MAX_LEAVES;
/// The largest integer (and dimension) an f32 holds exactly.
const EXACT: f32 = 16_777_216.0;
/// The most elements one activation carries (what one message may: 1 GiB of f32).
const MAX_ELEMS: usize = (1 << 30) / 4;

/// One tensor of an activation: whether it is an integer one, and its dimensions.
#[derive(Debug, Clone, PartialEq)]
struct Leaf {
    int: bool,
    dims: Vec<usize>,
}

/// The header and the elements of `act` (read to the host: one read per tensor).
pub fn encode(act: &Act) -> Result<(Vec<f32>, Vec<f32>), PipelineError> {
    if let Act::Tuple(v) = act
        && (v.len() < 2 || v.iter().any(|a| matches!(a, Act::Tuple(_))))
    {
        return Err(PipelineError::Activation(
            "a nested or one-element tuple cannot cross a stage boundary (it would arrive \
             flattened): pass a flat tuple of two or more tensors"
                .into(),
        ));
    }
    let mut leaves = Vec::new();
    let mut data = Vec::new();
    flatten(act, &mut leaves, &mut data)?;
    if leaves.len() > MAX_LEAVES {
        return Err(PipelineError::Activation(format!(
            "{} tensors cross the stage boundary, at most {MAX_LEAVES}",
            leaves.len()
        )));
    }
    let mut header = vec![0.0; HEADER_LEN];
    header[0] = leaves.len() as f32;
    for (k, l) in leaves.iter().enumerate() {
        let at = 1 + 6 * k;
        header[at] = f32::from(u8::from(l.int));
        header[at + 1] = l.dims.len() as f32;
        for (j, &d) in l.dims.iter().enumerate() {
            if d > 1 << 24 {
                return Err(PipelineError::Activation(format!(
                    "a dimension of {d} is above 2^24"
                )));
            }
            header[at + 2 + j] = d as f32;
        }
    }
    Ok((header, data))
}

/// The elements the activation that `header` describes holds (what the second message
/// carries); an error for a header no stage writes.
pub fn data_len(header: &[f32]) -> Result<usize, PipelineError> {
    Ok(leaves_of(header)?
        .iter()
        .map(|l| l.dims.iter().product::<usize>())
        .sum())
}

/// The activation `header` and `data` describe, on `device` (a tuple when it holds more than
/// one tensor, as [`encode`] flattened it).
pub fn decode(header: &[f32], data: Vec<f32>, device: &Device) -> Result<Act, PipelineError> {
    let leaves = leaves_of(header)?;
    let mut at = 0;
    let mut acts = Vec::with_capacity(leaves.len());
    for l in &leaves {
        let n: usize = l.dims.iter().product();
        let part = data.get(at..at + n).ok_or_else(|| {
            PipelineError::Activation(format!("{} elements for a header of more", data.len()))
        })?;
        at += n;
        acts.push(rebuild(l, part, device));
    }
    Ok(match acts.len() {
        1 => acts.pop().expect("one"),
        _ => Act::Tuple(acts),
    })
}

fn leaves_of(header: &[f32]) -> Result<Vec<Leaf>, PipelineError> {
    let bad = |why: &str| PipelineError::Activation(format!("a malformed header: {why}"));
    // A header value as a count: an integer from 0 to 2^24.
    let count = |x: f32| (x.fract() == 0.0 && (0.0..=EXACT).contains(&x)).then_some(x as usize);
    if header.len() != HEADER_LEN {
        return Err(bad("wrong length"));
    }
    let n = count(header[0]).filter(|n| (1..=MAX_LEAVES).contains(n));
    let n = n.ok_or_else(|| bad("tensor count"))?;
    let mut total = 0usize;
    (0..n)
        .map(|k| {
            let at = 1 + 6 * k;
            let int = match header[at] {
                0.0 => false,
                1.0 => true,
                _ => return Err(bad("kind")),
            };
            let rank = count(header[at + 1]).unwrap_or(0);
            if !(1..=if int { 3 } else { 4 }).contains(&rank) {
                return Err(bad("rank"));
            }
            let dims = header[at + 2..at + 2 + rank]
                .iter()
                .map(|&d| count(d).ok_or_else(|| bad("dimension")))
                .collect::<Result<Vec<usize>, _>>()?;
            let elems = dims.iter().try_fold(1usize, |a, &d| a.checked_mul(d));
            total = elems
                .and_then(|e| total.checked_add(e))
                .filter(|&t| t <= MAX_ELEMS)
                .ok_or_else(|| bad("more elements than a message carries"))?;
            Ok(Leaf { int, dims })
        })
        .collect()
}

fn flatten(act: &Act, leaves: &mut Vec<Leaf>, data: &mut Vec<f32>) -> Result<(), PipelineError> {
    let read = |e: burn::tensor::TensorReadError| PipelineError::Activation(e.to_string());
    let mut float = |dims: Vec<usize>, v: Vec<f32>| {
        data.extend(v);
        leaves.push(Leaf { int: false, dims });
        Ok(())
    };
    match act {
        Act::F1(t) => float(
            t.dims().to_vec(),
            transfer::read_f32(t.clone()).map_err(read)?,
        ),
        Act::F2(t) => float(
            t.dims().to_vec(),
            transfer::read_f32(t.clone()).map_err(read)?,
        ),
        Act::F3(t) => float(
            t.dims().to_vec(),
            transfer::read_f32(t.clone()).map_err(read)?,
        ),
        Act::F4(t) => float(
            t.dims().to_vec(),
            transfer::read_f32(t.clone()).map_err(read)?,
        ),
        Act::I1(t) => int(t.dims().to_vec(), t.clone().into_data(), leaves, data),
        Act::I2(t) => int(t.dims().to_vec(), t.clone().into_data(), leaves, data),
        Act::I3(t) => int(t.dims().to_vec(), t.clone().into_data(), leaves, data),
        Act::Tuple(v) => v.iter().try_for_each(|a| flatten(a, leaves, data)),
    }
}

fn int(
    dims: Vec<usize>,
    d: TensorData,
    leaves: &mut Vec<Leaf>,
    data: &mut Vec<f32>,
) -> Result<(), PipelineError> {
    // Checked as integers, before any rounding to f32.
    let mut v = Vec::with_capacity(d.num_elements());
    for x in d.iter::<i64>() {
        if x.unsigned_abs() > 1 << 24 {
            return Err(PipelineError::Activation(format!(
                "an integer activation of {x} is above 2^24 and cannot travel exactly"
            )));
        }
        v.push(x as f32);
    }
    data.extend(v);
    leaves.push(Leaf { int: true, dims });
    Ok(())
}

fn rebuild(l: &Leaf, part: &[f32], device: &Device) -> Act {
    if l.int {
        let ints: Vec<i64> = part.iter().map(|&x| x as i64).collect();
        let d = TensorData::new(ints, l.dims.clone());
        return match l.dims.len() {
            1 => Act::I1(Tensor::<1, Int>::from_data(d, device)),
            2 => Act::I2(Tensor::<2, Int>::from_data(d, device)),
            _ => Act::I3(Tensor::<3, Int>::from_data(d, device)),
        };
    }
    let flat = transfer::upload(part.to_vec(), device);
    match *l.dims.as_slice() {
        [_] => Act::F1(flat),
        [a, b] => Act::F2(flat.reshape([a, b])),
        [a, b, c] => Act::F3(flat.reshape([a, b, c])),
        [a, b, c, d] => Act::F4(flat.reshape([a, b, c, d])),
        _ => unreachable!("ranks 1 to 4, checked by leaves_of"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn floats(a: &Act) -> Vec<f32> {
        encode(a).unwrap().1
    }

    #[test]
    fn activations_of_every_kind_round_trip_and_bad_ones_are_refused() {
        let dev = Device::flex();
        let f3 = Tensor::<1>::from_floats([1.0, 2.0, 3.0, 4.0, 5.0, 6.0], &dev).reshape([1, 2, 3]);
        let ids = Tensor::<2, Int>::from_ints([[7, 8], [9, 16_777_216]], &dev);
        let act = Act::Tuple(vec![Act::F3(f3), Act::I2(ids)]);
        let (h, d) = encode(&act).unwrap();
        assert_eq!(data_len(&h).unwrap(), 10);
        let back = decode(&h, d.clone(), &dev).unwrap();
        assert_eq!(floats(&back), d);
        let Act::Tuple(parts) = &back else {
            panic!("a tuple")
        };
        assert!(matches!(&parts[0], Act::F3(t) if t.dims() == [1, 2, 3]));
        assert!(matches!(&parts[1], Act::I2(t) if t.dims() == [2, 2]));
        let one = Act::F2(Tensor::<2>::zeros([3, 4], &dev));
        let (h, d) = encode(&one).unwrap();
        assert!(matches!(decode(&h, d, &dev).unwrap(), Act::F2(t) if t.dims() == [3, 4]));
        // 2^24 + 1 would round to 2^24 as f32: refused, not rounded.
        let big = Act::I1(Tensor::<1, Int>::from_ints([16_777_217], &dev));
        assert!(encode(&big).unwrap_err().to_string().contains("above 2^24"));
        let nested = Act::Tuple(vec![
            Act::Tuple(vec![one.clone(), one.clone()]),
            one.clone(),
        ]);
        assert!(
            encode(&nested)
                .unwrap_err()
                .to_string()
                .contains("flat tuple")
        );
        assert!(encode(&Act::Tuple(vec![one.clone()])).is_err());
        let malformed = |at: usize, x: f32| {
            let mut bad = h.clone();
            bad[at] = x;
            data_len(&bad).unwrap_err().to_string()
        };
        assert!(malformed(0, 9.0).contains("tensor count"));
        assert!(malformed(1, 0.5).contains("kind"));
        assert!(malformed(2, 5.0).contains("rank"));
        assert!(malformed(3, 1e30).contains("dimension"));
        assert!(malformed(3, f32::NAN).contains("dimension"));
        let mut huge = h.clone();
        (huge[3], huge[4]) = (16_777_216.0, 16_777_216.0);
        let e = data_len(&huge).unwrap_err().to_string();
        assert!(e.contains("more elements than a message"), "{e}");
        assert!(decode(&h, vec![0.0; 5], &dev).is_err());
    }
}
