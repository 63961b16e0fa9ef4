//! HTTP/1.1 as the router speaks it on both sides, on `httparse`: the framing of message
//! bodies the engine client and the server share.

pub(crate) mod framing;
