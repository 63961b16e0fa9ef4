//! Where a cached block lives. Only the engine's own (GPU) cache makes a prefix free to reuse;
//! offloaded copies cost a load, so a policy opts into counting them.

/// A tier of an engine's KV cache.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Medium {
    /// The engine's own cache: `"GPU"`, or no `medium` at all (versions before the field).
    Gpu,
    /// Host memory: vLLM's `"CPU"`, SGLang's `"CPU_TIER1"`/`"CPU_TIER2"`.
    Cpu,
    /// Anything else an offloading connector names (`"STORAGE"`, disks, remote stores).
    Storage,
}

impl Medium {
    pub(crate) const EVERY: [Self; 3] = [Self::Gpu, Self::Cpu, Self::Storage];

    /// The tier of an event's `medium` field.
    pub fn of(medium: Option<&str>) -> Self {
        match medium {
            None | Some(switchyard_wire::kv_events::MEDIUM_GPU) => Self::Gpu,
            Some(name) if name.starts_with("CPU") => Self::Cpu,
            Some(_) => Self::Storage,
        }
    }
}

/// The tiers a lookup counts as cached.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct MediumSet(u8);

impl MediumSet {
    /// The default: only what the engine can reuse without a load.
    pub const GPU: Self = Self::of(Medium::Gpu);
    pub const ALL: Self = Self(0b111);
    pub(crate) const NONE: Self = Self(0);

    pub const fn of(medium: Medium) -> Self {
        Self(1 << medium as u8)
    }

    #[must_use]
    pub const fn with(self, medium: Medium) -> Self {
        Self(self.0 | Self::of(medium).0)
    }

    pub const fn contains(self, medium: Medium) -> bool {
        self.0 & Self::of(medium).0 != 0
    }

    pub(crate) fn is_empty(self) -> bool {
        self.0 == 0
    }

    pub(crate) fn without(self, medium: Medium) -> Self {
        Self(self.0 & !Self::of(medium).0)
    }
}

impl Default for MediumSet {
    fn default() -> Self {
        Self::GPU
    }
}
