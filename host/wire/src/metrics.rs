//! The engine gauges switchyard's router reads from an engine's `GET /metrics` (Prometheus
//! text) to give policies each endpoint's KV usage. The reference engine exports them under
//! these names; engines that do not are reported with unknown usage.

/// KV pages referenced by a request.
pub const KV_PAGES_USED: &str = "switchyard_engine_kv_pages_used";
/// KV pages an allocation can take (free or idle in the prefix cache).
pub const KV_PAGES_FREE: &str = "switchyard_engine_kv_pages_free";
