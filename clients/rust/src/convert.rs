//! Conversions between the contract's messages and ferrum's types.

use std::collections::HashMap;
use std::time::{Duration, Instant};

use ferrum_interfaces::model_executor::{
    AttentionType, ExecutorCapabilities, ExecutorMemoryUsage, ExecutorState, ExecutorStatus,
    KvSlotAllocation, KvSlotCapacitySnapshot, KvSlotRequest, KvSlotReservation, MemoryRequirements,
};
use ferrum_types::{DataType, Device, FerrumError, ModelId, ModelInfo, ModelType};
use prost_types::value::Kind;

use crate::proto;

// ---- JSON <-> google.protobuf.Struct -------------------------------------------------------

pub fn json_to_value(v: &serde_json::Value) -> prost_types::Value {
    let kind = match v {
        serde_json::Value::Null => Kind::NullValue(0),
        serde_json::Value::Bool(b) => Kind::BoolValue(*b),
        serde_json::Value::Number(n) => Kind::NumberValue(n.as_f64().unwrap_or(0.0)),
        serde_json::Value::String(s) => Kind::StringValue(s.clone()),
        serde_json::Value::Array(a) => {
            Kind::ListValue(prost_types::ListValue { values: a.iter().map(json_to_value).collect() })
        }
        serde_json::Value::Object(o) => Kind::StructValue(prost_types::Struct {
            fields: o.iter().map(|(k, v)| (k.clone(), json_to_value(v))).collect(),
        }),
    };
    prost_types::Value { kind: Some(kind) }
}

/// ferrum's `HashMap<String, serde_json::Value>` metadata as a Struct (None when empty).
pub fn json_map_to_struct(m: &HashMap<String, serde_json::Value>) -> Option<prost_types::Struct> {
    if m.is_empty() {
        return None;
    }
    Some(prost_types::Struct { fields: m.iter().map(|(k, v)| (k.clone(), json_to_value(v))).collect() })
}

pub fn value_to_json(v: &prost_types::Value) -> serde_json::Value {
    match &v.kind {
        None | Some(Kind::NullValue(_)) => serde_json::Value::Null,
        Some(Kind::BoolValue(b)) => serde_json::Value::Bool(*b),
        Some(Kind::NumberValue(n)) => {
            // Integers travel as doubles; give them back as integers when exact.
            if n.fract() == 0.0 && n.abs() < 9.0e15 {
                serde_json::Value::from(*n as i64)
            } else {
                serde_json::Number::from_f64(*n).map(serde_json::Value::Number).unwrap_or(serde_json::Value::Null)
            }
        }
        Some(Kind::StringValue(s)) => serde_json::Value::String(s.clone()),
        Some(Kind::ListValue(l)) => serde_json::Value::Array(l.values.iter().map(value_to_json).collect()),
        Some(Kind::StructValue(s)) => struct_to_json(s),
    }
}

pub fn struct_to_json(s: &prost_types::Struct) -> serde_json::Value {
    serde_json::Value::Object(s.fields.iter().map(|(k, v)| (k.clone(), value_to_json(v))).collect())
}

pub fn struct_to_json_map(s: Option<&prost_types::Struct>) -> HashMap<String, serde_json::Value> {
    s.map(|s| s.fields.iter().map(|(k, v)| (k.clone(), value_to_json(v))).collect()).unwrap_or_default()
}

// ---- request metadata ------------------------------------------------------------------------

/// The LoRA adapter ferrum's engine names in request metadata: `ferrum_lora_adapter`, with
/// `ferrum_lora_path` (the adapter's directory on the engine's machine), as ferrum's `LlmExecutor`
/// reads them. The contract's `adapter` field names an adapter registered on the server
/// (`LoadAdapter`, or `serve --adapter`), so only the name goes there; the path travels on in the
/// forwarded metadata and is not used to load anything. A path without a name is refused, as
/// ferrum refuses it; no name = "" (the base model, or a continued cache's own adapter).
pub fn lora_adapter_from_metadata(m: &HashMap<String, serde_json::Value>) -> Result<String, FerrumError> {
    let name = m.get("ferrum_lora_adapter").and_then(|v| v.as_str());
    let path = m.get("ferrum_lora_path").and_then(|v| v.as_str());
    match (name, path) {
        (Some(name), _) => Ok(name.to_string()),
        (None, None) => Ok(String::new()),
        (None, Some(_)) => Err(FerrumError::model(
            "incomplete LoRA metadata: ferrum_lora_path without ferrum_lora_adapter",
        )),
    }
}

// ---- enums ---------------------------------------------------------------------------------

pub fn data_type_from_proto(v: i32) -> DataType {
    use proto::DataType as P;
    match P::try_from(v).unwrap_or(P::Unspecified) {
        P::Fp32 | P::Unspecified => DataType::FP32,
        P::Fp16 => DataType::FP16,
        P::Bf16 => DataType::BF16,
        P::Fp8 => DataType::FP8,
        P::Int32 | P::Int64 => DataType::INT32,
        P::Int16 => DataType::INT16,
        P::Int8 => DataType::INT8,
        P::Int4 => DataType::INT4,
        P::Uint32 => DataType::UINT32,
        P::Uint16 => DataType::UINT16,
        P::Uint8 => DataType::UINT8,
        P::Uint4 => DataType::UINT4,
        P::Bool => DataType::BOOL,
    }
}

/// ferrum's `Device` from the contract's device string ("cpu", "cuda:0", "rocm:1", "metal").
/// `Device::Metal` exists only on Apple targets; elsewhere "metal" reads as CPU (the original
/// string stays in `ModelInfo.metadata["ferrum_remote_device"]`).
pub fn parse_device(s: &str) -> Device {
    let s = s.trim().to_ascii_lowercase();
    let idx = |rest: &str| rest.trim_start_matches(':').parse::<usize>().unwrap_or(0);
    if let Some(rest) = s.strip_prefix("cuda") {
        Device::CUDA(idx(rest))
    } else if let Some(rest) = s.strip_prefix("rocm") {
        Device::ROCm(idx(rest))
    } else {
        #[cfg(any(target_os = "macos", target_os = "ios"))]
        if s.starts_with("metal") || s.starts_with("mps") {
            return Device::Metal;
        }
        Device::CPU
    }
}

fn model_type_from_proto(v: i32, detail: &str, executor: &str) -> ModelType {
    use proto::ModelType as P;
    match P::try_from(v).unwrap_or(P::Unspecified) {
        P::Llama => ModelType::Llama,
        P::Mistral => ModelType::Mistral,
        P::Qwen => ModelType::Qwen,
        P::Phi => ModelType::Phi,
        P::Gemma => ModelType::Gemma,
        P::Code => ModelType::Code(detail.to_string()),
        P::Embedding => ModelType::Embedding,
        P::Clip => ModelType::Clip,
        P::Custom => ModelType::Custom(detail.to_string()),
        P::Unspecified => ModelType::Custom(if detail.is_empty() { executor.to_string() } else { detail.to_string() }),
    }
}

fn attention_from_proto(v: i32) -> Option<AttentionType> {
    use proto::AttentionType as P;
    Some(match P::try_from(v).ok()? {
        P::MultiHead => AttentionType::MultiHead,
        P::MultiQuery => AttentionType::MultiQuery,
        P::GroupedQuery => AttentionType::GroupedQuery,
        P::Flash => AttentionType::Flash,
        P::Paged => AttentionType::Paged,
        P::SlidingWindow => AttentionType::SlidingWindow,
        P::Unspecified => return None,
    })
}

// ---- messages ------------------------------------------------------------------------------

/// ferrum's `ModelInfo`. Fields the trait type lacks go to `metadata` under `ferrum_remote_*`
/// keys: executor, head_dim, eos_token_ids, has_tokenizer, has_chat_template, device string.
pub fn model_info_from_proto(m: &proto::ModelInfo) -> ModelInfo {
    let mut metadata = struct_to_json_map(m.metadata.as_ref());
    metadata.insert("ferrum_remote_executor".into(), m.executor.clone().into());
    metadata.insert("ferrum_remote_head_dim".into(), m.head_dim.into());
    metadata.insert("ferrum_remote_eos_token_ids".into(), m.eos_token_ids.clone().into());
    metadata.insert("ferrum_remote_has_tokenizer".into(), m.has_tokenizer.into());
    metadata.insert("ferrum_remote_has_chat_template".into(), m.has_chat_template.into());
    metadata.insert("ferrum_remote_device".into(), m.device.clone().into());
    let opt = |s: &str| if s.is_empty() { None } else { Some(s.to_string()) };
    ModelInfo {
        model_id: ModelId::new(m.model_id.clone()),
        model_type: model_type_from_proto(m.model_type, &m.model_type_detail, &m.executor),
        num_parameters: m.num_parameters,
        hidden_size: m.hidden_size as usize,
        num_layers: m.num_layers as usize,
        num_heads: m.num_heads as usize,
        num_kv_heads: m.num_kv_heads as usize,
        vocab_size: m.vocab_size as usize,
        max_sequence_length: m.max_sequence_length as usize,
        dtype: data_type_from_proto(m.dtype),
        device: parse_device(&m.device),
        version: opt(&m.version),
        license: opt(&m.license),
        metadata,
    }
}

pub fn capabilities_from_proto(c: &proto::ExecutorCapabilities) -> ExecutorCapabilities {
    let mem = c.memory_requirements.unwrap_or_default();
    ExecutorCapabilities {
        max_batch_size: c.max_batch_size as usize,
        max_sequence_length: c.max_sequence_length as usize,
        attention_mechanisms: c.attention_mechanisms.iter().filter_map(|&a| attention_from_proto(a)).collect(),
        supports_dynamic_batching: c.supports_dynamic_batching,
        supports_continuous_batching: c.supports_continuous_batching,
        supports_speculative_decoding: c.supports_speculative_decoding,
        supports_tensor_parallelism: c.supports_tensor_parallelism,
        supports_pipeline_parallelism: c.supports_pipeline_parallelism,
        supported_dtypes: c.supported_dtypes.iter().map(|&d| data_type_from_proto(d)).collect(),
        supported_devices: c.supported_devices.iter().map(|d| parse_device(d)).collect(),
        memory_requirements: MemoryRequirements {
            parameter_memory: mem.parameter_memory_bytes,
            activation_memory_per_token: mem.activation_memory_per_token_bytes as usize,
            kv_cache_memory_per_token: mem.kv_cache_memory_per_token_bytes as usize,
            overhead_memory: mem.overhead_memory_bytes,
        },
    }
}

pub fn status_from_proto(s: &proto::ExecutorStatus) -> ExecutorStatus {
    use proto::ExecutorState as P;
    let state = match P::try_from(s.state).unwrap_or(P::Unspecified) {
        P::Initializing => ExecutorState::Initializing,
        P::Ready => ExecutorState::Ready,
        P::Busy => ExecutorState::Busy,
        P::Error => ExecutorState::Error,
        P::Shutdown => ExecutorState::Shutdown,
        P::Unspecified => {
            if s.is_ready {
                ExecutorState::Ready
            } else {
                ExecutorState::Initializing
            }
        }
    };
    let mem = s.memory_usage.unwrap_or_default();
    ExecutorStatus {
        state,
        is_ready: s.is_ready,
        current_batch_size: s.current_batch_size as usize,
        prefill_operations: s.prefill_operations,
        decode_operations: s.decode_operations,
        avg_prefill_time_ms: s.avg_prefill_time_ms,
        avg_decode_time_ms: s.avg_decode_time_ms,
        memory_usage: ExecutorMemoryUsage {
            allocated_bytes: mem.allocated_bytes as usize,
            used_bytes: mem.used_bytes as usize,
            peak_bytes: mem.peak_bytes as usize,
            utilization_percent: mem.utilization_percent,
        },
        last_operation: s
            .ns_since_last_operation
            .and_then(|ns| Instant::now().checked_sub(Duration::from_nanos(ns))),
    }
}

pub fn slot_request_to_proto(r: &KvSlotRequest) -> proto::KvSlotRequest {
    proto::KvSlotRequest {
        cache_id: r.cache_id.clone(),
        target_len: r.target_len as u64,
        admission_target_len: r.admission_target_len.map(|x| x as u64),
        new_sequence: false,
    }
}

pub fn reservation_from_proto(r: &proto::KvSlotReservation) -> KvSlotReservation {
    KvSlotReservation {
        block_size: r.block_size as usize,
        total_blocks: r.total_blocks as usize,
        free_blocks_before: r.free_blocks_before as usize,
        free_blocks_after: r.free_blocks_after as usize,
        allocations: r
            .allocations
            .iter()
            .map(|a| KvSlotAllocation {
                cache_id: a.cache_id.clone(),
                blocks_before: a.blocks_before as usize,
                blocks_after: a.blocks_after as usize,
                new_blocks: a.new_blocks as usize,
            })
            .collect(),
    }
}

pub fn slot_snapshot_from_proto(s: &proto::KvSlotCapacitySnapshot) -> KvSlotCapacitySnapshot {
    KvSlotCapacitySnapshot {
        block_size: s.block_size as usize,
        total_blocks: s.total_blocks as usize,
        free_blocks: s.free_blocks as usize,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn json_struct_roundtrip() {
        let v = serde_json::json!({"a": 1, "b": [true, "x", 2.5], "c": {"d": null}});
        let m: HashMap<String, serde_json::Value> = serde_json::from_value(v.clone()).unwrap();
        let s = json_map_to_struct(&m).unwrap();
        assert_eq!(struct_to_json(&s), v);
    }

    #[test]
    fn lora_adapter_metadata() {
        let md = |pairs: &[(&str, serde_json::Value)]| -> HashMap<String, serde_json::Value> {
            pairs.iter().map(|(k, v)| (k.to_string(), v.clone())).collect()
        };
        let both = md(&[("ferrum_lora_adapter", "sql".into()), ("ferrum_lora_path", "/adapters/sql".into())]);
        assert_eq!(lora_adapter_from_metadata(&both).unwrap(), "sql");
        // a name alone: an adapter registered on the server under that name
        assert_eq!(lora_adapter_from_metadata(&md(&[("ferrum_lora_adapter", "sql".into())])).unwrap(), "sql");
        assert_eq!(lora_adapter_from_metadata(&HashMap::new()).unwrap(), "");
        let path_only = md(&[("ferrum_lora_path", "/adapters/sql".into())]);
        assert!(matches!(lora_adapter_from_metadata(&path_only), Err(FerrumError::Model { .. })));
    }

    #[test]
    fn devices() {
        assert_eq!(parse_device("cuda:1"), Device::CUDA(1));
        assert_eq!(parse_device("cpu"), Device::CPU);
        assert_eq!(parse_device("rocm:0"), Device::ROCm(0));
    }
}
