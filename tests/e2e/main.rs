mod engine;
mod examples;
mod router;
