//! Which endpoints serve which model: each endpoint's list (what its `/v1/models` last said,
//! or what the operator pinned), indexed by model when a list changes so that a request's
//! snapshot is filtered without building anything per request.

use std::collections::HashMap;
use std::sync::Arc;

use switchyard_contract::{EndpointSnapshot, Health};

use super::EndpointState;
use crate::engine_client::ModelCard;

/// The endpoints (removed ones aside) by the models they list.
#[derive(Debug, Default)]
pub(super) struct ModelIndex {
    /// Model id → the endpoints that list it, ascending.
    endpoints: HashMap<String, Vec<u32>>,
    /// Adapter id → the base model it runs on, as the engines report it.
    parents: HashMap<String, String>,
}

impl ModelIndex {
    pub(super) fn build(endpoints: &[Arc<EndpointState>]) -> ModelIndex {
        let mut index = ModelIndex::default();
        for e in endpoints.iter().filter(|e| !e.is_removed()) {
            for ModelCard { id, parent } in e.models.read().iter() {
                let ids = index.endpoints.entry(id.clone()).or_default();
                // Ascending: endpoints are visited in id order; an engine listing a model twice
                // counts once.
                if ids.last() != Some(&e.id) {
                    ids.push(e.id);
                }
                if let Some(parent) = parent {
                    index.parents.insert(id.clone(), parent.clone());
                }
            }
        }
        index
    }

    /// The endpoints that list `model`; `None` when none does.
    pub(super) fn serving(&self, model: &str) -> Option<&[u32]> {
        self.endpoints.get(model).map(Vec::as_slice)
    }

    /// The base model an adapter runs on.
    pub(super) fn parent(&self, model: &str) -> Option<&str> {
        self.parents.get(model).map(String::as_str)
    }

    /// Shows every endpoint that does not serve `model` as a tombstone (`Removed`): the 0.2.0
    /// bindings leave it out of what a policy sees, 0.1.0 policies keep `snapshot[id].id == id`,
    /// and a plan naming it is refused. A model no endpoint lists (the router's own name for
    /// engines that call their model something else) leaves the snapshot whole.
    pub(super) fn hide_others(&self, model: &str, snapshot: &mut [EndpointSnapshot]) {
        let Some(serving) = self.serving(model) else {
            return;
        };
        for e in snapshot {
            if serving.binary_search(&e.id).is_err() {
                e.health = Health::Removed;
            }
        }
    }
}
