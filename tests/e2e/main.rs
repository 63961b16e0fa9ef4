mod edge;
mod engine;
mod examples;
mod faults;
mod http;
mod router;
