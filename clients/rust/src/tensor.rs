//! Host tensors over the bytes the contract carries.
//!
//! ferrum's trait moves tensors as `Arc<dyn TensorLike>`. Over the wire they are packed
//! little-endian bytes (`ferrum.executor.v1.Tensor`). [`HostTensor`] is a CPU, row-major, f32
//! tensor: logits rows come back as FP32 (FP16/BF16 rows are widened on arrival), and the token-id
//! tensors ferrum's engine builds (`[1, len]` f32) go out as `int32` ids. [`HostTensorFactory`] is
//! the matching `TensorFactory`, so an engine can be composed with this crate alone.

use std::any::Any;
use std::sync::Arc;

use ferrum_interfaces::{TensorFactory, TensorLike, TensorRef};
use ferrum_types::{DataType, Device, FerrumError, Result};

use crate::proto;

/// A dense CPU tensor stored as f32, row-major.
///
/// `dtype` is the element type the tensor stands for (FP32 for logits, FP32 for ferrum's token-id
/// tensors); the storage is always f32, which represents every value the contract sends exactly
/// (FP16/BF16 widen losslessly, token ids are below 2^24).
#[derive(Clone)]
pub struct HostTensor {
    data: Arc<[f32]>,
    shape: Vec<usize>,
    dtype: DataType,
}

impl std::fmt::Debug for HostTensor {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("HostTensor")
            .field("shape", &self.shape)
            .field("dtype", &self.dtype)
            .finish()
    }
}

impl HostTensor {
    /// A tensor over `data` with `shape` (their sizes must agree).
    pub fn new(data: Vec<f32>, shape: Vec<usize>) -> Result<Self> {
        Self::with_dtype(data, shape, DataType::FP32)
    }

    /// Like [`HostTensor::new`], labelled with another element type.
    pub fn with_dtype(data: Vec<f32>, shape: Vec<usize>, dtype: DataType) -> Result<Self> {
        let numel: usize = shape.iter().product();
        if numel != data.len() {
            return Err(FerrumError::invalid_parameter(format!(
                "tensor shape {shape:?} needs {numel} elements, got {}",
                data.len()
            )));
        }
        Ok(Self { data: data.into(), shape, dtype })
    }

    /// Token ids as ferrum's engine passes them: an f32 tensor of shape `[1, len]`.
    pub fn token_ids(ids: &[u32]) -> Self {
        let data: Vec<f32> = ids.iter().map(|&t| t as f32).collect();
        let len = data.len();
        Self { data: data.into(), shape: vec![1, len], dtype: DataType::FP32 }
    }

    /// The same, as a `TensorRef`.
    pub fn token_ids_ref(ids: &[u32]) -> TensorRef {
        Arc::new(Self::token_ids(ids))
    }

    /// Borrow the elements.
    pub fn data(&self) -> &[f32] {
        &self.data
    }

    /// Decode a wire tensor (FP32, FP16, BF16, INT32, INT64, UINT8 / BOOL) into f32 storage.
    pub fn from_proto(t: &proto::Tensor) -> Result<Self> {
        let shape: Vec<usize> = t
            .shape
            .iter()
            .map(|&d| usize::try_from(d).map_err(|_| FerrumError::invalid_format(format!("negative dimension {d} in tensor"))))
            .collect::<Result<_>>()?;
        let dt = proto::DataType::try_from(t.dtype).unwrap_or(proto::DataType::Unspecified);
        let b = &t.data;
        let (data, dtype): (Vec<f32>, DataType) = match dt {
            proto::DataType::Fp32 | proto::DataType::Unspecified => (
                chunks::<4>(b)?.map(f32::from_le_bytes).collect(),
                DataType::FP32,
            ),
            proto::DataType::Fp16 => (
                chunks::<2>(b)?.map(|c| f16_to_f32(u16::from_le_bytes(c))).collect(),
                DataType::FP16,
            ),
            proto::DataType::Bf16 => (
                chunks::<2>(b)?
                    .map(|c| f32::from_bits((u16::from_le_bytes(c) as u32) << 16))
                    .collect(),
                DataType::BF16,
            ),
            proto::DataType::Int32 => (
                chunks::<4>(b)?.map(|c| i32::from_le_bytes(c) as f32).collect(),
                DataType::INT32,
            ),
            proto::DataType::Int64 => (
                // Not a ferrum dtype; token ids fit f32 exactly.
                chunks::<8>(b)?.map(|c| i64::from_le_bytes(c) as f32).collect(),
                DataType::INT32,
            ),
            proto::DataType::Uint8 | proto::DataType::Bool => (
                b.iter().map(|&x| x as f32).collect(),
                if dt == proto::DataType::Bool { DataType::BOOL } else { DataType::UINT8 },
            ),
            other => {
                return Err(FerrumError::unsupported(format!(
                    "tensor dtype {other:?} is not decoded by this client"
                )))
            }
        };
        Self::with_dtype(data, shape, dtype)
    }

    /// Encode as a wire tensor: FP32, or INT32 when `as_int32` (token ids for `Forward`).
    pub fn to_proto(&self, as_int32: bool) -> Result<proto::Tensor> {
        let shape = self.shape.iter().map(|&d| d as i64).collect();
        if as_int32 {
            let mut data = Vec::with_capacity(self.data.len() * 4);
            for &v in self.data.iter() {
                data.extend_from_slice(&f32_to_token_id(v)?.to_le_bytes());
            }
            Ok(proto::Tensor { dtype: proto::DataType::Int32 as i32, shape, data })
        } else {
            let mut data = Vec::with_capacity(self.data.len() * 4);
            for &v in self.data.iter() {
                data.extend_from_slice(&v.to_le_bytes());
            }
            Ok(proto::Tensor { dtype: proto::DataType::Fp32 as i32, shape, data })
        }
    }
}

fn chunks<const N: usize>(b: &[u8]) -> Result<impl Iterator<Item = [u8; N]> + '_> {
    if b.len() % N != 0 {
        return Err(FerrumError::invalid_format(format!(
            "tensor data of {} bytes is not a multiple of the element size {N}",
            b.len()
        )));
    }
    Ok(b.chunks_exact(N).map(|c| {
        let mut a = [0u8; N];
        a.copy_from_slice(c);
        a
    }))
}

/// IEEE half → single (exact).
pub(crate) fn f16_to_f32(h: u16) -> f32 {
    let sign = ((h >> 15) as u32) << 31;
    let exp = ((h >> 10) & 0x1f) as u32;
    let mant = (h & 0x3ff) as u32;
    let bits = if exp == 0 {
        if mant == 0 {
            sign
        } else {
            // Subnormal: normalise.
            let mut e: i32 = -1;
            let mut m = mant;
            while m & 0x400 == 0 {
                m <<= 1;
                e -= 1;
            }
            let m = m & 0x3ff;
            sign | (((127 - 15 + 1 + e) as u32) << 23) | (m << 13)
        }
    } else if exp == 0x1f {
        sign | 0x7f80_0000 | (mant << 13)
    } else {
        sign | ((exp + 127 - 15) << 23) | (mant << 13)
    };
    f32::from_bits(bits)
}

/// An f32 that must hold a token id (a non-negative integer).
pub(crate) fn f32_to_token_id(v: f32) -> Result<i32> {
    if !v.is_finite() || v.fract() != 0.0 || v < i32::MIN as f32 || v > i32::MAX as f32 {
        return Err(FerrumError::invalid_parameter(format!(
            "token-id tensor holds {v}, which is not an integer token id"
        )));
    }
    Ok(v as i32)
}

/// Token ids of a ferrum token-id tensor (`[1, len]` or `[len]`, f32 as the engine sends them, or
/// any tensor whose `to_vec_u32` works). Signed, as the contract carries them.
pub fn tensor_token_ids(t: &TensorRef) -> Result<Vec<i32>> {
    match t.to_vec_f32() {
        Ok(v) => v.into_iter().map(f32_to_token_id).collect(),
        Err(_) => Ok(t
            .to_vec_u32()?
            .into_iter()
            .map(|x| x.min(i32::MAX as u32) as i32)
            .collect()),
    }
}

fn strides(shape: &[usize]) -> Vec<usize> {
    let mut s = vec![1; shape.len()];
    for i in (0..shape.len().saturating_sub(1)).rev() {
        s[i] = s[i + 1] * shape[i + 1];
    }
    s
}

impl TensorLike for HostTensor {
    fn as_any(&self) -> &dyn Any {
        self
    }
    fn shape(&self) -> &[usize] {
        &self.shape
    }
    fn dtype(&self) -> DataType {
        self.dtype
    }
    fn device(&self) -> Device {
        Device::CPU
    }
    fn is_contiguous(&self) -> bool {
        true
    }

    /// Copies `[start, end)` per dimension (row-major), as ferrum's `MockTensor` does.
    fn view(&self, start: &[usize], end: &[usize]) -> Result<TensorRef> {
        let nd = self.shape.len();
        if start.len() != nd || end.len() != nd {
            return Err(FerrumError::invalid_parameter(format!(
                "view of a {nd}-D tensor needs {nd} start and end indices"
            )));
        }
        for d in 0..nd {
            if start[d] > end[d] || end[d] > self.shape[d] {
                return Err(FerrumError::invalid_parameter(format!(
                    "view [{}, {}) out of range for dimension {d} of size {}",
                    start[d], end[d], self.shape[d]
                )));
            }
        }
        let out_shape: Vec<usize> = (0..nd).map(|d| end[d] - start[d]).collect();
        let numel: usize = out_shape.iter().product();
        let st = strides(&self.shape);
        let mut out = Vec::with_capacity(numel);
        if numel > 0 {
            let mut idx = start.to_vec();
            'outer: loop {
                let off: usize = idx.iter().zip(&st).map(|(i, s)| i * s).sum();
                out.push(self.data[off]);
                // Advance the multi-index, last dimension fastest.
                let mut d = nd;
                loop {
                    if d == 0 {
                        break 'outer;
                    }
                    d -= 1;
                    idx[d] += 1;
                    if idx[d] < end[d] {
                        break;
                    }
                    idx[d] = start[d];
                }
            }
        }
        Ok(Arc::new(HostTensor::with_dtype(out, out_shape, self.dtype)?))
    }

    fn reshape(&self, shape: &[usize]) -> Result<TensorRef> {
        let numel: usize = shape.iter().product();
        if numel != self.data.len() {
            return Err(FerrumError::invalid_parameter(format!(
                "cannot reshape {:?} to {shape:?}",
                self.shape
            )));
        }
        Ok(Arc::new(HostTensor { data: self.data.clone(), shape: shape.to_vec(), dtype: self.dtype }))
    }

    fn to_cpu(&self) -> Result<TensorRef> {
        Ok(Arc::new(self.clone()))
    }

    fn to_device(&self, device: &Device) -> Result<TensorRef> {
        match device {
            Device::CPU => Ok(Arc::new(self.clone())),
            other => Err(FerrumError::unsupported(format!(
                "HostTensor lives on the CPU; moving it to {other:?} is not supported"
            ))),
        }
    }

    /// Relabels the element type (storage stays f32). Float types only.
    fn to_dtype(&self, dtype: DataType) -> Result<TensorRef> {
        Ok(Arc::new(HostTensor { data: self.data.clone(), shape: self.shape.clone(), dtype }))
    }

    fn to_vec_f32(&self) -> Result<Vec<f32>> {
        Ok(self.data.to_vec())
    }

    fn to_vec_u32(&self) -> Result<Vec<u32>> {
        self.data
            .iter()
            .map(|&v| {
                if v.is_finite() && v >= 0.0 && v.fract() == 0.0 && v <= u32::MAX as f32 {
                    Ok(v as u32)
                } else {
                    Err(FerrumError::invalid_parameter(format!("{v} is not a u32")))
                }
            })
            .collect()
    }

    /// Argmax over all elements; ties go to the LAST index (Rust `max_by`, as ferrum's
    /// `MockTensor` and `GreedySampler`). A 1-element tensor is ferrum's greedy sentinel and
    /// yields its value.
    fn argmax_last_dim_u32(&self) -> Result<u32> {
        if self.data.len() == 1 {
            return f32_to_token_id(self.data[0]).map(|t| t as u32);
        }
        let last = *self.shape.last().unwrap_or(&0);
        if last == 0 {
            return Err(FerrumError::invalid_parameter("argmax of an empty tensor"));
        }
        let row = &self.data[self.data.len() - last..];
        let (i, _) = row
            .iter()
            .enumerate()
            .max_by(|a, b| a.1.partial_cmp(b.1).unwrap_or(std::cmp::Ordering::Equal))
            .expect("non-empty");
        Ok(i as u32)
    }
}

/// `TensorFactory` producing [`HostTensor`]s (CPU only).
#[derive(Debug, Default, Clone)]
pub struct HostTensorFactory {
    seed: std::sync::Arc<std::sync::atomic::AtomicU64>,
}

impl HostTensorFactory {
    pub fn new() -> Self {
        Self { seed: Arc::new(std::sync::atomic::AtomicU64::new(0x9E37_79B9_7F4A_7C15)) }
    }

    fn cpu(device: &Device) -> Result<()> {
        match device {
            Device::CPU => Ok(()),
            other => Err(FerrumError::unsupported(format!(
                "HostTensorFactory makes CPU tensors only, not {other:?}"
            ))),
        }
    }

    fn filled(shape: &[usize], v: f32, dtype: DataType) -> Result<TensorRef> {
        let n: usize = shape.iter().product();
        Ok(Arc::new(HostTensor::with_dtype(vec![v; n], shape.to_vec(), dtype)?))
    }

    /// splitmix64 → uniform [0, 1).
    fn next_unit(&self) -> f32 {
        let mut z = self.seed.fetch_add(0x9E37_79B9_7F4A_7C15, std::sync::atomic::Ordering::Relaxed);
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^= z >> 31;
        (z >> 40) as f32 / (1u64 << 24) as f32
    }
}

impl TensorFactory for HostTensorFactory {
    fn empty(&self, shape: &[usize], dtype: DataType, device: Device) -> Result<TensorRef> {
        Self::cpu(&device)?;
        Self::filled(shape, 0.0, dtype)
    }
    fn zeros_like(&self, tensor: &TensorRef) -> Result<TensorRef> {
        Self::filled(tensor.shape(), 0.0, tensor.dtype())
    }
    fn from_slice(&self, data: &[f32], shape: &[usize], dtype: DataType, device: Device) -> Result<TensorRef> {
        Self::cpu(&device)?;
        Ok(Arc::new(HostTensor::with_dtype(data.to_vec(), shape.to_vec(), dtype)?))
    }
    fn to_device(&self, tensor: &TensorRef, device: Device) -> Result<TensorRef> {
        tensor.to_device(&device)
    }
    fn narrow(&self, tensor: &TensorRef, dim: usize, start: usize, length: usize) -> Result<TensorRef> {
        let shape = tensor.shape().to_vec();
        if dim >= shape.len() {
            return Err(FerrumError::invalid_parameter(format!("narrow: no dimension {dim}")));
        }
        let mut s = vec![0; shape.len()];
        let mut e = shape.clone();
        s[dim] = start;
        e[dim] = start + length;
        let host = HostTensor::with_dtype(tensor.to_vec_f32()?, shape, tensor.dtype())?;
        host.view(&s, &e)
    }
    fn reshape(&self, tensor: &TensorRef, shape: &[usize]) -> Result<TensorRef> {
        tensor.reshape(shape)
    }
    fn zeros(&self, shape: &[usize], dtype: DataType, device: &Device) -> Result<TensorRef> {
        Self::cpu(device)?;
        Self::filled(shape, 0.0, dtype)
    }
    fn ones(&self, shape: &[usize], dtype: DataType, device: &Device) -> Result<TensorRef> {
        Self::cpu(device)?;
        Self::filled(shape, 1.0, dtype)
    }
    fn uniform(&self, shape: &[usize], low: f32, high: f32, dtype: DataType, device: &Device) -> Result<TensorRef> {
        Self::cpu(device)?;
        let n: usize = shape.iter().product();
        let data = (0..n).map(|_| low + (high - low) * self.next_unit()).collect();
        Ok(Arc::new(HostTensor::with_dtype(data, shape.to_vec(), dtype)?))
    }
    fn normal(&self, shape: &[usize], mean: f32, std: f32, dtype: DataType, device: &Device) -> Result<TensorRef> {
        Self::cpu(device)?;
        let n: usize = shape.iter().product();
        // Box-Muller.
        let data = (0..n)
            .map(|_| {
                let u1 = self.next_unit().max(f32::MIN_POSITIVE);
                let u2 = self.next_unit();
                mean + std * (-2.0 * u1.ln()).sqrt() * (2.0 * std::f32::consts::PI * u2).cos()
            })
            .collect();
        Ok(Arc::new(HostTensor::with_dtype(data, shape.to_vec(), dtype)?))
    }
    fn from_tensor(&self, tensor: &TensorRef, device: &Device) -> Result<TensorRef> {
        Self::cpu(device)?;
        Ok(Arc::new(HostTensor::with_dtype(tensor.to_vec_f32()?, tensor.shape().to_vec(), tensor.dtype())?))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn view_last_position_of_3d() {
        let t = HostTensor::new((0..12).map(|x| x as f32).collect(), vec![1, 3, 4]).unwrap();
        let v = t.view(&[0, 2, 0], &[1, 3, 4]).unwrap();
        assert_eq!(v.shape(), &[1, 1, 4]);
        assert_eq!(v.to_vec_f32().unwrap(), vec![8.0, 9.0, 10.0, 11.0]);
    }

    #[test]
    fn wire_roundtrip_and_half_types() {
        let t = HostTensor::new(vec![1.5, -2.0, 0.0], vec![3]).unwrap();
        let p = t.to_proto(false).unwrap();
        assert_eq!(HostTensor::from_proto(&p).unwrap().data(), &[1.5, -2.0, 0.0]);
        // 1.0 in fp16 = 0x3c00, in bf16 = 0x3f80.
        let h = proto::Tensor { dtype: proto::DataType::Fp16 as i32, shape: vec![1], data: 0x3c00u16.to_le_bytes().to_vec() };
        assert_eq!(HostTensor::from_proto(&h).unwrap().data(), &[1.0]);
        let b = proto::Tensor { dtype: proto::DataType::Bf16 as i32, shape: vec![1], data: 0x3f80u16.to_le_bytes().to_vec() };
        assert_eq!(HostTensor::from_proto(&b).unwrap().data(), &[1.0]);
    }

    #[test]
    fn token_ids_and_argmax_ties_go_last() {
        let ids: TensorRef = HostTensor::token_ids_ref(&[3, 7]);
        assert_eq!(ids.shape(), &[1, 2]);
        assert_eq!(tensor_token_ids(&ids).unwrap(), vec![3, 7]);
        let t = HostTensor::new(vec![0.0, 5.0, 5.0, 1.0], vec![1, 4]).unwrap();
        assert_eq!(t.argmax_last_dim_u32().unwrap(), 2);
        let bad: TensorRef = Arc::new(HostTensor::new(vec![1.5], vec![1, 1]).unwrap());
        assert!(tensor_token_ids(&bad).is_err());
    }
}
