//! An [`Act`] as two messages between stages: a fixed-size header that describes its tensors
//! (kind, rank, dimensions; what the receiver needs to post the second receive and rebuild
//! the tensors) and the elements of all of them, as f32. Integer tensors (token ids, masks)
//! travel as f32 too, exactly while they stay within ±2^24; larger ones are refused.

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

/// One tensor of an activation: whether it is an integer one, and its dimensions.
#[derive(Debug, Clone, PartialEq)]
struct Leaf {
    int: bool,
    dims: Vec<usize>,
}

/// The header and the elements of `act` (read to the host: one read per tensor).
pub fn encode(act: &Act) -> Result<(Vec<f32>, Vec<f32>), PipelineError> {
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
            if d as f32 > EXACT {
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
    if header.len() != HEADER_LEN {
        return Err(bad("wrong length"));
    }
    let n = header[0] as usize;
    if header[0].fract() != 0.0 || n == 0 || n > MAX_LEAVES {
        return Err(bad("tensor count"));
    }
    (0..n)
        .map(|k| {
            let at = 1 + 6 * k;
            let rank = header[at + 1] as usize;
            if !(1..=4).contains(&rank) || header[at] > 1.0 {
                return Err(bad("kind or rank"));
            }
            let dims: Vec<usize> = header[at + 2..at + 2 + rank]
                .iter()
                .map(|&d| d as usize)
                .collect();
            Ok(Leaf {
                int: header[at] == 1.0,
                dims,
            })
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
        Act::I1(t) => int(t.dims().to_vec(), t.clone().float(), leaves, data),
        Act::I2(t) => int(
            t.dims().to_vec(),
            t.clone().float().flatten(0, 1),
            leaves,
            data,
        ),
        Act::I3(t) => int(
            t.dims().to_vec(),
            t.clone().float().flatten(0, 2),
            leaves,
            data,
        ),
        Act::Tuple(v) => v.iter().try_for_each(|a| flatten(a, leaves, data)),
    }
}

fn int(
    dims: Vec<usize>,
    flat: Tensor<1>,
    leaves: &mut Vec<Leaf>,
    data: &mut Vec<f32>,
) -> Result<(), PipelineError> {
    let v = transfer::read_f32(flat).map_err(|e| PipelineError::Activation(e.to_string()))?;
    if let Some(x) = v.iter().find(|x| x.abs() > EXACT) {
        return Err(PipelineError::Activation(format!(
            "an integer activation of {x} is above 2^24 and cannot travel exactly"
        )));
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
        let big = Act::I1(Tensor::<1, Int>::from_ints([16_777_217 * 2], &dev));
        assert!(encode(&big).unwrap_err().to_string().contains("above 2^24"));
        let mut bad = h.clone();
        bad[0] = 9.0;
        assert!(
            data_len(&bad)
                .unwrap_err()
                .to_string()
                .contains("malformed")
        );
        assert!(decode(&h, vec![0.0; 5], &dev).is_err());
    }
}
