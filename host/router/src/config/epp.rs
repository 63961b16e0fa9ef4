//! `switchyard epp`'s own settings: its flags, or the file's `[epp]` table (which `serve`
//! reads and ignores, so one file configures both).

use super::table::settings;

/// `--grpc-port`'s default, the Inference Extension's.
pub const DEFAULT_GRPC_PORT: u16 = 9002;
pub const DEFAULT_GRPC_HEALTH_PORT: u16 = 9003;
pub const DEFAULT_METRICS_PORT: u16 = 9090;

settings! {
    /// The Endpoint Picker's ports and answers (`switchyard epp` only; the file's `[epp]`
    /// table has their keys).
    args EndpointPickerArgs, keys EndpointPickerKeys, resolved EndpointPickerSettings, table "epp";

    /// Port of the ext_proc gRPC service the gateway calls (0 picks a free one) [default:
    /// 9002].
    grpc_port: Option<u16> => u16 {
        flag: "grpc-port",
        key: "grpc_port",
        default: DEFAULT_GRPC_PORT,
    }
    /// Port of the gRPC health services `liveness`, `readiness` and
    /// `envoy.service.ext_proc.v3.ExternalProcessor` (0 picks a free one) [default: 9003].
    grpc_health_port: Option<u16> => u16 {
        flag: "grpc-health-port",
        key: "grpc_health_port",
        default: DEFAULT_GRPC_HEALTH_PORT,
    }
    /// Port of the Prometheus `/metrics` (and `/health`, `/livez`) (0 picks a free one)
    /// [default: 9090].
    metrics_port: Option<u16> => u16 {
        flag: "metrics-port",
        key: "metrics_port",
        default: DEFAULT_METRICS_PORT,
    }
    /// Fallback endpoints after the pick, for gateways that walk an ordered list
    /// (`override_host`): the destination becomes `ip:port,ip:port,…`, each next endpoint the
    /// policy's plan with the ones before marked failed [default: 0, one `ip:port`, as Envoy's
    /// `ORIGINAL_DST` cluster needs].
    #[arg(value_name = "N")]
    destination_fallbacks: Option<usize> => usize {
        flag: "destination-fallbacks",
        key: "destination_fallbacks",
        default: 0,
    }
}

/// The EPP's settings, resolved.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct EndpointPicker {
    pub grpc_port: u16,
    pub grpc_health_port: u16,
    pub metrics_port: u16,
    /// Endpoints the answer names after the pick.
    pub destination_fallbacks: usize,
}

impl EndpointPickerSettings {
    pub(super) fn endpoint_picker(&self) -> EndpointPicker {
        EndpointPicker {
            grpc_port: self.grpc_port.value,
            grpc_health_port: self.grpc_health_port.value,
            metrics_port: self.metrics_port.value,
            destination_fallbacks: self.destination_fallbacks.value,
        }
    }
}
