mod backends;
mod book;
mod continuation;
mod edge;
mod engine;
mod examples;
mod faults;
mod hardening;
mod http;
mod interop;
#[cfg(feature = "k8s")]
mod k8s;
mod kv_aware;
mod kv_events;
mod lab;
mod protocols;
mod replicas;
mod router;
