mod edge;
mod engine;
mod examples;
mod faults;
mod hardening;
mod http;
mod router;
