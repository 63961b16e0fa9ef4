mod engine;
mod examples;
mod http;
mod router;
