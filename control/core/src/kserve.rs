//! The KServe Open Inference Protocol (v2) as far as Laneway checks it: the tensor metadata a
//! model file declares, the protocol's datatypes and their sizes, and the layout of the binary
//! tensor data extension (Triton's `binary_tensor_data`): a JSON header of
//! `Inference-Header-Content-Length` bytes, then each binary tensor's bytes in the order of
//! the tensors that name a `binary_data_size`.
//!
//! Pure functions: the router checks a request with them before it costs a replica slot, the
//! simulated model server decodes with them.

use serde::{Deserialize, Serialize};
use serde_json::Value;

/// Request and response header of the binary extension: the length of the JSON part.
pub const INFERENCE_HEADER: &str = "inference-header-content-length";

/// Most tensors a model declares on each side.
pub const MAX_TENSORS: usize = 64;
/// Most dimensions of a tensor.
pub const MAX_DIMS: usize = 16;

/// A tensor of a model's signature, as `GET /v2/models/{m}` reports it. `-1` in `shape` is a
/// dimension of any size (a batch, a sequence).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TensorSpec {
    pub name: String,
    pub datatype: String,
    pub shape: Vec<i64>,
}

/// The protocol's datatypes and the bytes of one element (`None`: `BYTES`, each element a
/// 4-byte little-endian length and that many bytes).
pub fn element_bytes(datatype: &str) -> Option<Option<usize>> {
    Some(match datatype {
        "BOOL" | "UINT8" | "INT8" => Some(1),
        "UINT16" | "INT16" | "FP16" | "BF16" => Some(2),
        "UINT32" | "INT32" | "FP32" => Some(4),
        "UINT64" | "INT64" | "FP64" => Some(8),
        "BYTES" => None,
        _ => return None,
    })
}

const DATATYPES: &str = "BOOL, UINT8, UINT16, UINT32, UINT64, INT8, INT16, INT32, INT64, FP16, BF16, FP32, FP64, BYTES";

impl TensorSpec {
    /// Checks a declared tensor (`side`: `inputs` or `outputs`).
    pub fn validate(&self, side: &str) -> Result<(), String> {
        let n = &self.name;
        if n.is_empty() || n.len() > 128 || n.chars().any(|c| c.is_control()) {
            return Err(format!("{side}: tensor name {n:?}: give 1-128 printable characters"));
        }
        if element_bytes(&self.datatype).is_none() {
            return Err(format!(
                "{side}.{n}: datatype {:?} is not a KServe v2 datatype; use one of {DATATYPES}",
                self.datatype
            ));
        }
        if self.shape.len() > MAX_DIMS {
            return Err(format!(
                "{side}.{n}: {} dimensions; at most {MAX_DIMS}",
                self.shape.len()
            ));
        }
        if let Some(d) = self.shape.iter().find(|d| **d < -1) {
            return Err(format!(
                "{side}.{n}: dimension {d}; give a size of 0 or more, or -1 for any size"
            ));
        }
        Ok(())
    }
}

/// Checks a model's declared `inputs` and `outputs`: valid, at most [`MAX_TENSORS`] a side,
/// names unique on each side.
pub fn validate_signature(inputs: &[TensorSpec], outputs: &[TensorSpec]) -> Result<(), String> {
    for (side, tensors) in [("inputs", inputs), ("outputs", outputs)] {
        if tensors.len() > MAX_TENSORS {
            return Err(format!("{} {side}; at most {MAX_TENSORS}", tensors.len()));
        }
        let mut seen = std::collections::BTreeSet::new();
        for t in tensors {
            t.validate(side)?;
            if !seen.insert(t.name.as_str()) {
                return Err(format!("{side}: tensor {} is declared twice", t.name));
            }
        }
    }
    Ok(())
}

/// Elements of a tensor of a request's `shape` (every dimension given: no `-1`).
pub fn elements(name: &str, shape: &[i64]) -> Result<u64, String> {
    shape.iter().try_fold(1u64, |n, d| {
        let d = u64::try_from(*d).map_err(|_| {
            format!("input {name}: shape {shape:?} has a negative dimension; a request gives every dimension's size")
        })?;
        n.checked_mul(d)
            .ok_or_else(|| format!("input {name}: shape {shape:?} is too large"))
    })
}

/// Checks that `bytes` hold a whole tensor of `datatype` and `shape` in the binary layout.
pub fn check_binary(name: &str, datatype: &str, shape: &[i64], bytes: &[u8]) -> Result<(), String> {
    let n = elements(name, shape)?;
    match element_bytes(datatype) {
        None => Err(format!(
            "input {name}: datatype {datatype:?} is not a KServe v2 datatype; use one of {DATATYPES}"
        )),
        Some(Some(size)) => {
            let want = n.saturating_mul(size as u64);
            if bytes.len() as u64 == want {
                Ok(())
            } else {
                Err(format!(
                    "input {name}: binary_data_size is {} bytes; {datatype} {shape:?} is {n} elements of {size} bytes = {want}",
                    bytes.len()
                ))
            }
        }
        Some(None) => {
            let mut rest = bytes;
            let mut count = 0u64;
            while !rest.is_empty() {
                let Some((len, tail)) = rest.split_first_chunk::<4>() else {
                    return Err(format!(
                        "input {name}: BYTES element {count} is cut off in its 4-byte length"
                    ));
                };
                let len = u32::from_le_bytes(*len) as usize;
                if tail.len() < len {
                    return Err(format!(
                        "input {name}: BYTES element {count} says {len} bytes; {} are left",
                        tail.len()
                    ));
                }
                rest = &tail[len..];
                count += 1;
            }
            if count == n {
                Ok(())
            } else {
                Err(format!(
                    "input {name}: {count} BYTES elements in its binary data; shape {shape:?} is {n}"
                ))
            }
        }
    }
}

/// The JSON part's length an `Inference-Header-Content-Length` value gives: plain decimal
/// digits, nothing else (so every reader of the body splits it at the same place).
pub fn json_part_len(value: &[u8]) -> Result<usize, String> {
    std::str::from_utf8(value)
        .ok()
        .filter(|v| !v.is_empty() && v.bytes().all(|b| b.is_ascii_digit()))
        .and_then(|v| v.parse().ok())
        .ok_or_else(|| {
            format!(
                "{INFERENCE_HEADER}: {:?} is not a length; it gives the bytes of the JSON part of a binary request",
                String::from_utf8_lossy(value)
            )
        })
}

/// The JSON header and the binary part of a request or answer whose
/// `Inference-Header-Content-Length` is `header_len`.
pub fn split_binary(body: &[u8], header_len: usize) -> Result<(&[u8], &[u8]), String> {
    if header_len > body.len() {
        return Err(format!(
            "{INFERENCE_HEADER} is {header_len} but the body is {} bytes; it gives the length of the JSON part",
            body.len()
        ));
    }
    Ok(body.split_at(header_len))
}

/// The elements of a binary tensor as JSON values (numbers, booleans, or strings for BYTES
/// that are UTF-8), as a server answering in JSON would give them; `None` for a datatype with
/// no plain JSON form (FP16, BF16) or bytes that do not divide into elements.
pub fn decode(datatype: &str, bytes: &[u8]) -> Option<Vec<Value>> {
    fn each<const N: usize>(bytes: &[u8], f: impl Fn([u8; N]) -> Value) -> Option<Vec<Value>> {
        let chunks = bytes.chunks_exact(N);
        if !chunks.remainder().is_empty() {
            return None;
        }
        Some(chunks.map(|c| f(c.try_into().expect("chunks of N"))).collect())
    }
    match datatype {
        "BOOL" => each::<1>(bytes, |b| Value::Bool(b[0] != 0)),
        "UINT8" => each::<1>(bytes, |b| Value::from(b[0])),
        "INT8" => each::<1>(bytes, |b| Value::from(i8::from_le_bytes(b))),
        "UINT16" => each::<2>(bytes, |b| Value::from(u16::from_le_bytes(b))),
        "INT16" => each::<2>(bytes, |b| Value::from(i16::from_le_bytes(b))),
        "UINT32" => each::<4>(bytes, |b| Value::from(u32::from_le_bytes(b))),
        "INT32" => each::<4>(bytes, |b| Value::from(i32::from_le_bytes(b))),
        "UINT64" => each::<8>(bytes, |b| Value::from(u64::from_le_bytes(b))),
        "INT64" => each::<8>(bytes, |b| Value::from(i64::from_le_bytes(b))),
        "FP32" => each::<4>(bytes, |b| Value::from(f64::from(f32::from_le_bytes(b)))),
        "FP64" => each::<8>(bytes, |b| Value::from(f64::from_le_bytes(b))),
        "BYTES" => {
            let mut out = Vec::new();
            let mut rest = bytes;
            while let Some((len, tail)) = rest.split_first_chunk::<4>() {
                let len = u32::from_le_bytes(*len) as usize;
                let s = tail.get(..len)?;
                out.push(Value::String(String::from_utf8_lossy(s).into_owned()));
                rest = &tail[len..];
            }
            rest.is_empty().then_some(out)
        }
        _ => None,
    }
}

/// Why raw tensor bytes have no lossless JSON form (`None`: they do): NaN or infinite floats
/// (JSON has no number for them), BYTES elements that are not UTF-8 (an image).
pub fn json_loss(datatype: &str, raw: &[u8]) -> Option<&'static str> {
    match datatype {
        "FP32" => raw
            .chunks_exact(4)
            .any(|c| !f32::from_le_bytes(c.try_into().expect("4 bytes")).is_finite())
            .then_some("a NaN or infinite value, which JSON has no number for"),
        "FP64" => raw
            .chunks_exact(8)
            .any(|c| !f64::from_le_bytes(c.try_into().expect("8 bytes")).is_finite())
            .then_some("a NaN or infinite value, which JSON has no number for"),
        "BYTES" => {
            let mut rest = raw;
            let mut bad = false;
            while let Some((len, tail)) = rest.split_first_chunk::<4>() {
                let len = (u32::from_le_bytes(*len) as usize).min(tail.len());
                bad |= std::str::from_utf8(&tail[..len]).is_err();
                rest = &tail[len..];
            }
            bad.then_some("an element that is not UTF-8 text, which JSON strings cannot carry")
        }
        _ => None,
    }
}

/// A request in the binary tensor data extension (`body`, its JSON part `json_len` bytes,
/// already checked) as the same request in plain JSON, for a server that reads only JSON
/// (MLServer's REST API, ADR 0027): each binary input's bytes become its `data`, and outputs
/// are asked for as JSON (a client that asked for binary outputs reads JSON ones as well).
/// Refused, saying why, for more than `max_elements` elements (each grows into a JSON value)
/// or a value JSON cannot carry unchanged.
pub fn binary_request_as_json(body: &[u8], json_len: usize, max_elements: u64) -> Result<Vec<u8>, String> {
    let (json, mut rest) = split_binary(body, json_len)?;
    let mut doc: Value = serde_json::from_slice(json).map_err(|e| format!("invalid inference request: {e}"))?;
    let mut total = 0u64;
    for input in doc["inputs"].as_array_mut().into_iter().flatten() {
        let name = input["name"].as_str().unwrap_or("?").to_string();
        let datatype = input["datatype"].as_str().unwrap_or("").to_string();
        let shape: Vec<i64> = input["shape"]
            .as_array()
            .into_iter()
            .flatten()
            .filter_map(Value::as_i64)
            .collect();
        let Some(size) = input
            .pointer_mut("/parameters")
            .and_then(Value::as_object_mut)
            .and_then(|p| p.remove("binary_data_size"))
        else {
            continue;
        };
        total = total.saturating_add(elements(&name, &shape)?);
        if total > max_elements {
            return Err(format!(
                "its inputs have more than {max_elements} elements, more than the router converts to JSON; send smaller tensors"
            ));
        }
        let size = size
            .as_u64()
            .and_then(|s| usize::try_from(s).ok())
            .filter(|s| *s <= rest.len())
            .ok_or_else(|| format!("input {name}: binary_data_size runs past the body"))?;
        let (raw, tail) = rest.split_at(size);
        rest = tail;
        if let Some(why) = json_loss(&datatype, raw) {
            return Err(format!("input {name} has {why}"));
        }
        let data = decode(&datatype, raw).ok_or_else(|| format!("input {name}: {datatype} has no JSON form"))?;
        input["data"] = Value::Array(data);
        if input["parameters"].as_object().is_some_and(|p| p.is_empty()) {
            input.as_object_mut().map(|o| o.remove("parameters"));
        }
    }
    for output in doc["outputs"].as_array_mut().into_iter().flatten() {
        if let Some(p) = output.pointer_mut("/parameters").and_then(Value::as_object_mut) {
            p.remove("binary_data");
        }
    }
    if let Some(p) = doc.pointer_mut("/parameters").and_then(Value::as_object_mut) {
        p.remove("binary_data_output");
    }
    serde_json::to_vec(&doc).map_err(|e| e.to_string())
}

/// The inverse of [`decode`]: a tensor's JSON `data` (flat, or nested row-major as the v2
/// JSON form allows) as its raw little-endian bytes (BYTES: each element a 4-byte length and
/// its bytes), for a protocol that carries raw contents (the v2 gRPC `raw_output_contents`).
/// Errors name the element that does not fit the datatype.
pub fn encode(name: &str, datatype: &str, data: &Value) -> Result<Vec<u8>, String> {
    fn flat<'a>(v: &'a Value, out: &mut Vec<&'a Value>) {
        match v {
            Value::Array(items) => items.iter().for_each(|i| flat(i, out)),
            other => out.push(other),
        }
    }
    let mut values = Vec::new();
    flat(data, &mut values);
    let mut out = Vec::with_capacity(values.len() * element_bytes(datatype).flatten().unwrap_or(4));
    let bad = |i: usize, v: &Value| format!("tensor {name}: element {i} ({v}) is not a {datatype} value");
    for (i, v) in values.into_iter().enumerate() {
        let int = || v.as_i64().ok_or_else(|| bad(i, v));
        let uint = || v.as_u64().ok_or_else(|| bad(i, v));
        let ranged = |lo: i64, hi: i64| int().and_then(|n| if (lo..=hi).contains(&n) { Ok(n) } else { Err(bad(i, v)) });
        match datatype {
            "BOOL" => out.push(u8::from(v.as_bool().ok_or_else(|| bad(i, v))?)),
            "UINT8" => out.push(ranged(0, 255)? as u8),
            "INT8" => out.extend_from_slice(&(ranged(-128, 127)? as i8).to_le_bytes()),
            "UINT16" => out.extend_from_slice(&(ranged(0, 65_535)? as u16).to_le_bytes()),
            "INT16" => out.extend_from_slice(&(ranged(-32_768, 32_767)? as i16).to_le_bytes()),
            "UINT32" => out.extend_from_slice(&(ranged(0, u32::MAX.into())? as u32).to_le_bytes()),
            "INT32" => out.extend_from_slice(&(ranged(i32::MIN.into(), i32::MAX.into())? as i32).to_le_bytes()),
            "UINT64" => out.extend_from_slice(&uint()?.to_le_bytes()),
            "INT64" => out.extend_from_slice(&int()?.to_le_bytes()),
            "FP32" => out.extend_from_slice(&(v.as_f64().ok_or_else(|| bad(i, v))? as f32).to_le_bytes()),
            "FP64" => out.extend_from_slice(&v.as_f64().ok_or_else(|| bad(i, v))?.to_le_bytes()),
            "BYTES" => {
                let s = v.as_str().ok_or_else(|| bad(i, v))?;
                let len = u32::try_from(s.len()).map_err(|_| bad(i, v))?;
                out.extend_from_slice(&len.to_le_bytes());
                out.extend_from_slice(s.as_bytes());
            }
            other => {
                return Err(format!(
                    "tensor {name}: {other} has no JSON form to convert (FP16 and BF16 travel only as binary tensors)"
                ))
            }
        }
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn binary_tensors_are_checked_by_datatype_and_shape() {
        assert!(check_binary("x", "FP32", &[2, 2], &[0u8; 16]).is_ok());
        let e = check_binary("x", "FP32", &[2, 2], &[0u8; 12]).unwrap_err();
        assert!(e.contains("12 bytes") && e.contains("= 16"), "{e}");
        let e = check_binary("x", "FP32", &[-1, 2], &[0u8; 8]).unwrap_err();
        assert!(e.contains("negative dimension"), "{e}");
        let mut two = Vec::new();
        for s in ["ab", ""] {
            two.extend_from_slice(&(s.len() as u32).to_le_bytes());
            two.extend_from_slice(s.as_bytes());
        }
        assert!(check_binary("s", "BYTES", &[2], &two).is_ok());
        assert!(check_binary("s", "BYTES", &[3], &two)
            .unwrap_err()
            .contains("2 BYTES elements"));
        assert!(check_binary("s", "BYTES", &[1], &two[..5])
            .unwrap_err()
            .contains("says 2 bytes"));
        assert_eq!(decode("BYTES", &two), Some(vec![Value::from("ab"), Value::from("")]));
        assert!(check_binary("x", "FP8", &[1], &[0])
            .unwrap_err()
            .contains("not a KServe v2 datatype"));
    }

    #[test]
    fn json_data_encodes_to_the_bytes_it_decodes_from() {
        for (datatype, data) in [
            ("FP32", serde_json::json!([[1.5, -2.0], [0.25, 4.0]])),
            ("INT64", serde_json::json!([7, -9])),
            ("UINT8", serde_json::json!([0, 255])),
            ("INT16", serde_json::json!([-32768, 32767])),
            ("BOOL", serde_json::json!([true, false])),
            ("BYTES", serde_json::json!(["ab", ""])),
        ] {
            let bytes = encode("t", datatype, &data).unwrap();
            let mut flat = Vec::new();
            for v in data.as_array().unwrap() {
                match v {
                    Value::Array(row) => flat.extend(row.iter().cloned()),
                    v => flat.push(v.clone()),
                }
            }
            assert_eq!(decode(datatype, &bytes), Some(flat), "{datatype}");
        }
        let e = encode("t", "UINT8", &serde_json::json!([256])).unwrap_err();
        assert!(e.contains("element 0 (256) is not a UINT8"), "{e}");
        let e = encode("t", "INT32", &serde_json::json!(["x"])).unwrap_err();
        assert!(e.contains("tensor t") && e.contains("INT32"), "{e}");
        assert!(encode("t", "FP16", &serde_json::json!([1.0]))
            .unwrap_err()
            .contains("only as binary"));
    }

    #[test]
    fn binary_decodes_little_endian_numbers() {
        let bytes: Vec<u8> = [1.5f32, -2.0].iter().flat_map(|f| f.to_le_bytes()).collect();
        assert_eq!(decode("FP32", &bytes), Some(vec![Value::from(1.5), Value::from(-2.0)]));
        assert_eq!(decode("INT64", &7i64.to_le_bytes()), Some(vec![Value::from(7)]));
        assert_eq!(decode("FP32", &[0, 0, 0]), None);
        assert_eq!(decode("FP16", &[0, 0]), None);
    }

    #[test]
    fn a_signature_is_checked_on_register() {
        let t = |name: &str, datatype: &str, shape: Vec<i64>| TensorSpec {
            name: name.into(),
            datatype: datatype.into(),
            shape,
        };
        assert!(validate_signature(&[t("x", "FP32", vec![-1, 4])], &[t("y", "INT64", vec![-1])]).is_ok());
        let e = validate_signature(&[t("x", "FLOAT", vec![1])], &[]).unwrap_err();
        assert!(e.contains("inputs.x") && e.contains("FP32"), "{e}");
        let e = validate_signature(&[], &[t("y", "FP32", vec![1]), t("y", "FP32", vec![1])]).unwrap_err();
        assert!(e.contains("declared twice"), "{e}");
        let e = validate_signature(&[t("x", "FP32", vec![-2])], &[]).unwrap_err();
        assert!(e.contains("-1 for any size"), "{e}");
        assert!(split_binary(b"{}", 3).unwrap_err().contains("length of the JSON part"));
    }
}
