//! A GGUF file's metadata (its key/value header), read without any ML framework, and what the
//! router needs from it: the model's name, context length, chat template and tokenizer, and
//! what an engine running it needs to turn ids back into text ([`Vocabulary`]).
//!
//! The engine loads the tensors with candle; the router must never depend on candle, so the
//! tokenizer is built here, from the GGUF's own tokens and merges, and both sides use this one
//! builder. Only the header is read: the tensor data after it is never touched.
//!
//! Format (GGUF v2/v3, little-endian): magic `GGUF`, version u32, tensor count u64, key/value
//! count u64, then each key (u64 length + UTF-8) with a u32 value type and the value.
//!
//! ```no_run
//! use switchyard_wire::gguf::GgufMetadata;
//!
//! let meta = GgufMetadata::read("SmolLM2-135M-Instruct.Q4_1.gguf".as_ref())?;
//! let files = meta.model_files()?;
//! let tokenizer = files.tokenizer()?;
//! let ids = tokenizer.encode("The capital of France is", false).unwrap();
//! assert_eq!(ids.get_ids(), &[504, 3575, 282, 4649, 314]);
//! # Ok::<(), switchyard_wire::gguf::GgufError>(())
//! ```

use std::collections::{BTreeMap, HashMap};
use std::io::{BufReader, Read};
use std::path::{Path, PathBuf};

use serde_json::json;
use tokenizers::Tokenizer;

/// Why a GGUF file's metadata could not be read or used.
#[derive(Debug, thiserror::Error)]
pub enum GgufError {
    #[error("cannot read GGUF {path}: {source}")]
    Io {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("{path} is not a GGUF file we read: {reason}")]
    Format { path: PathBuf, reason: String },
    #[error("GGUF metadata key {key:?}: {reason}")]
    Key { key: String, reason: String },
    #[error("cannot build the tokenizer from GGUF metadata: {0}")]
    Tokenizer(String),
}

/// One metadata value. Integers of every width are widened; arrays keep their items.
#[derive(Debug, Clone, PartialEq)]
pub enum Value {
    UInt(u64),
    Int(i64),
    Float(f64),
    Bool(bool),
    Str(String),
    Array(Vec<Value>),
}

/// The key/value header of a GGUF file.
#[derive(Debug, Clone)]
pub struct GgufMetadata {
    pub version: u32,
    pub tensor_count: u64,
    pub values: BTreeMap<String, Value>,
}

/// The file name `make model` (`scripts/fetch-model.py`) extracts into the cache.
pub const SMOLLM2_FILE: &str = "SmolLM2-135M-Instruct.Q4_1.gguf";

/// Where fetched models live: `$SWITCHYARD_CACHE`, else `$XDG_CACHE_HOME/switchyard`, else
/// `~/.cache/switchyard` (`scripts/fetch-model.py` follows the same rule). `env` looks a
/// variable up, so tests never touch the process environment.
pub fn model_cache_dir(env: impl Fn(&str) -> Option<String>) -> Option<PathBuf> {
    let set = |key: &str| env(key).filter(|v| !v.is_empty());
    if let Some(dir) = set("SWITCHYARD_CACHE") {
        return Some(PathBuf::from(dir));
    }
    if let Some(dir) = set("XDG_CACHE_HOME") {
        return Some(PathBuf::from(dir).join("switchyard"));
    }
    set("HOME").map(|home| PathBuf::from(home).join(".cache").join("switchyard"))
}

/// The name a GGUF model is served under by default: its file name up to the first dot
/// (`SmolLM2-135M-Instruct.Q4_1.gguf` is `SmolLM2-135M-Instruct`).
pub fn served_name(path: &Path) -> String {
    let file = path
        .file_name()
        .map(|f| f.to_string_lossy())
        .unwrap_or_default();
    file.split('.').next().unwrap_or_default().to_owned()
}

/// The fetched SmolLM2 GGUF in the cache this process's environment names.
pub fn smollm2_path() -> Option<PathBuf> {
    model_cache_dir(|key| std::env::var(key).ok()).map(|dir| dir.join(SMOLLM2_FILE))
}

const MAGIC: &[u8; 4] = b"GGUF";
/// Bounds on what a header may claim, so a corrupt length fails cleanly instead of allocating.
const MAX_STRING: u64 = 1 << 24;
const MAX_ARRAY: u64 = 1 << 24;
const MAX_KEYS: u64 = 1 << 16;

impl GgufMetadata {
    /// Reads the header of the GGUF file at `path`.
    pub fn read(path: &Path) -> Result<Self, GgufError> {
        let file = std::fs::File::open(path).map_err(|source| GgufError::Io {
            path: path.to_owned(),
            source,
        })?;
        let mut r = Reader {
            inner: BufReader::with_capacity(1 << 20, file),
            path,
        };
        let mut magic = [0; 4];
        r.bytes(&mut magic)?;
        if &magic != MAGIC {
            return Err(r.format("no GGUF magic"));
        }
        let version = r.u32()?;
        if !(2..=3).contains(&version) {
            return Err(r.format(&format!("version {version} (2 and 3 are read)")));
        }
        let tensor_count = r.u64()?;
        let kv_count = r.u64()?;
        if kv_count > MAX_KEYS {
            return Err(r.format(&format!("{kv_count} metadata keys")));
        }
        let mut values = BTreeMap::new();
        for _ in 0..kv_count {
            let key = r.string()?;
            let kind = r.u32()?;
            let value = r.value(kind)?;
            values.insert(key, value);
        }
        Ok(GgufMetadata {
            version,
            tensor_count,
            values,
        })
    }

    pub fn get(&self, key: &str) -> Option<&Value> {
        self.values.get(key)
    }

    fn require(&self, key: &str) -> Result<&Value, GgufError> {
        self.get(key).ok_or_else(|| GgufError::Key {
            key: key.into(),
            reason: "missing".into(),
        })
    }

    /// A string value.
    pub fn str(&self, key: &str) -> Result<&str, GgufError> {
        match self.require(key)? {
            Value::Str(s) => Ok(s),
            other => Err(wrong_type(key, "a string", other)),
        }
    }

    /// A non-negative integer value.
    pub fn uint(&self, key: &str) -> Result<u64, GgufError> {
        match self.require(key)? {
            Value::UInt(v) => Ok(*v),
            Value::Int(v) if *v >= 0 => Ok(*v as u64),
            other => Err(wrong_type(key, "a non-negative integer", other)),
        }
    }

    /// A float value (integers are accepted).
    pub fn float(&self, key: &str) -> Result<f64, GgufError> {
        match self.require(key)? {
            Value::Float(v) => Ok(*v),
            Value::UInt(v) => Ok(*v as f64),
            Value::Int(v) => Ok(*v as f64),
            other => Err(wrong_type(key, "a number", other)),
        }
    }

    /// An array of strings.
    pub fn strings(&self, key: &str) -> Result<Vec<&str>, GgufError> {
        match self.require(key)? {
            Value::Array(items) => items
                .iter()
                .map(|v| match v {
                    Value::Str(s) => Ok(s.as_str()),
                    other => Err(wrong_type(key, "an array of strings", other)),
                })
                .collect(),
            other => Err(wrong_type(key, "an array", other)),
        }
    }

    /// An array of integers.
    pub fn ints(&self, key: &str) -> Result<Vec<i64>, GgufError> {
        match self.require(key)? {
            Value::Array(items) => items
                .iter()
                .map(|v| match v {
                    Value::Int(i) => Ok(*i),
                    Value::UInt(u) => i64::try_from(*u).map_err(|_| wrong_type(key, "i64", v)),
                    other => Err(wrong_type(key, "an array of integers", other)),
                })
                .collect(),
            other => Err(wrong_type(key, "an array", other)),
        }
    }

    /// The model architecture (`general.architecture`, e.g. `llama`).
    pub fn architecture(&self) -> Result<&str, GgufError> {
        self.str("general.architecture")
    }

    /// `<architecture>.<key>` as an unsigned integer.
    pub fn arch_uint(&self, key: &str) -> Result<u64, GgufError> {
        self.uint(&format!("{}.{key}", self.architecture()?))
    }

    /// `<architecture>.<key>` as a float.
    pub fn arch_float(&self, key: &str) -> Result<f64, GgufError> {
        self.float(&format!("{}.{key}", self.architecture()?))
    }

    /// What a Hugging Face model directory would hold for this model's tokenizer: the files the
    /// router's `--model-dir` loads, and the ids the engine stops on.
    pub fn model_files(&self) -> Result<ModelFiles, GgufError> {
        let tokens = self.strings("tokenizer.ggml.tokens")?;
        let types = self.ints("tokenizer.ggml.token_type")?;
        let token_text = |key: &str| -> Result<Option<String>, GgufError> {
            match self.get(key) {
                None => Ok(None),
                Some(_) => {
                    let id = self.uint(key)? as usize;
                    tokens
                        .get(id)
                        .map(|t| Some((*t).to_owned()))
                        .ok_or_else(|| GgufError::Key {
                            key: key.into(),
                            reason: format!("token id {id} is past the vocabulary"),
                        })
                }
            }
        };
        let eos_token = token_text("tokenizer.ggml.eos_token_id")?;
        let bos_token = token_text("tokenizer.ggml.bos_token_id")?;
        let eos_id = match self.get("tokenizer.ggml.eos_token_id") {
            Some(_) => Some(self.uint("tokenizer.ggml.eos_token_id")? as u32),
            None => None,
        };
        let tokenizer_json = tokenizer_json(self, &tokens, &types)?;
        let mut config = json!({
            "model_max_length": self.arch_uint("context_length").ok(),
            "bos_token": bos_token,
            "eos_token": eos_token,
            "add_bos_token": matches!(self.get("tokenizer.ggml.add_bos_token"), Some(Value::Bool(true))),
        });
        if let Ok(template) = self.str("tokenizer.chat_template") {
            config["chat_template"] = json!(template);
        }
        Ok(ModelFiles {
            name: self.str("general.name").ok().map(str::to_owned),
            context_length: self.arch_uint("context_length").ok(),
            eos_id,
            tokenizer_json: tokenizer_json.to_string(),
            tokenizer_config_json: config.to_string(),
        })
    }
}

/// A GGUF model's tokenizer as Hugging Face files, with the facts a server reports.
#[derive(Debug, Clone)]
pub struct ModelFiles {
    /// `general.name`.
    pub name: Option<String>,
    pub context_length: Option<u64>,
    pub eos_id: Option<u32>,
    /// A `tokenizer.json` (the `tokenizers` crate's format).
    pub tokenizer_json: String,
    /// A `tokenizer_config.json`: chat template, BOS and EOS tokens.
    pub tokenizer_config_json: String,
}

impl ModelFiles {
    pub fn tokenizer(&self) -> Result<Tokenizer, GgufError> {
        self.tokenizer_json
            .parse::<Tokenizer>()
            .map_err(|e| GgufError::Tokenizer(e.to_string()))
    }
}

/// What a server running a GGUF model needs to turn its ids back into text and to stop: the
/// other direction from [`ModelFiles::tokenizer`], read from the same token table.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Vocabulary {
    /// The bytes each token id stands for; empty for control tokens, which are never streamed.
    pub token_bytes: Vec<Vec<u8>>,
    /// Ids that end a generation: the GGUF's EOS, and `<|endoftext|>` where it is a control
    /// token (chat models end a turn with one and may emit the other).
    pub stop_ids: Vec<u32>,
}

impl GgufMetadata {
    /// The model's [`Vocabulary`]. A token is written in GPT-2's byte-level alphabet; a symbol
    /// outside it (a user-defined token) stands for its own UTF-8 text.
    pub fn vocabulary(&self) -> Result<Vocabulary, GgufError> {
        let tokens = self.strings("tokenizer.ggml.tokens")?;
        let types = self.ints("tokenizer.ggml.token_type")?;
        let byte_of = gpt2_byte_decoder();
        let mut stop_ids: Vec<u32> = match self.get("tokenizer.ggml.eos_token_id") {
            Some(_) => vec![self.uint("tokenizer.ggml.eos_token_id")? as u32],
            None => Vec::new(),
        };
        let token_bytes = tokens
            .iter()
            .zip(types.iter().chain(std::iter::repeat(&1)))
            .enumerate()
            .map(|(id, (text, &ty))| {
                if ty == TOKEN_TYPE_CONTROL {
                    if *text == "<|endoftext|>" && !stop_ids.contains(&(id as u32)) {
                        stop_ids.push(id as u32);
                    }
                    return Vec::new();
                }
                let mut bytes = Vec::with_capacity(text.len());
                for ch in text.chars() {
                    match byte_of.get(&ch) {
                        Some(&b) => bytes.push(b),
                        None => bytes.extend_from_slice(ch.encode_utf8(&mut [0; 4]).as_bytes()),
                    }
                }
                bytes
            })
            .collect();
        Ok(Vocabulary {
            token_bytes,
            stop_ids,
        })
    }
}

/// GPT-2's byte-level alphabet, reversed: the char each byte is written as in a token, to the
/// byte. Printable bytes stand for themselves; the rest map to U+0100 onwards in order.
fn gpt2_byte_decoder() -> HashMap<char, u8> {
    let printable = |b: u8| matches!(b, b'!'..=b'~' | 0xA1..=0xAC | 0xAE..=0xFF);
    let mut next = 256u32;
    (0..=255u8)
        .map(|b| {
            if printable(b) {
                (char::from(b), b)
            } else {
                let ch = char::from_u32(next).unwrap_or(char::REPLACEMENT_CHARACTER);
                next += 1;
                (ch, b)
            }
        })
        .collect()
}

/// GGUF token types (llama.cpp's `llama_token_type`): control tokens are special (never split
/// out of plain text, skipped when decoding), and so are user-defined ones.
const TOKEN_TYPE_CONTROL: i64 = 3;
const TOKEN_TYPE_USER_DEFINED: i64 = 4;

/// The `tokenizer.json` of a GGUF `gpt2` (byte-level BPE) tokenizer.
///
/// The pre-tokenizer is chosen by `tokenizer.ggml.pre`, as llama.cpp does; only the ones whose
/// Hugging Face equivalent is known are accepted, because a wrong split silently changes ids.
fn tokenizer_json(
    meta: &GgufMetadata,
    tokens: &[&str],
    types: &[i64],
) -> Result<serde_json::Value, GgufError> {
    let model = meta.str("tokenizer.ggml.model")?;
    if model != "gpt2" {
        return Err(GgufError::Tokenizer(format!(
            "tokenizer model {model:?} (only byte-level BPE, \"gpt2\", is supported)"
        )));
    }
    let byte_level = json!({
        "type": "ByteLevel", "add_prefix_space": false, "trim_offsets": true, "use_regex": true
    });
    let pre = meta.str("tokenizer.ggml.pre").unwrap_or("default");
    let pre_tokenizer = match pre {
        // SmolLM's: every digit on its own, then GPT-2's split, no prefix space.
        "smollm" => json!({
            "type": "Sequence",
            "pretokenizers": [{"type": "Digits", "individual_digits": true}, byte_level],
        }),
        "gpt2" | "default" => byte_level,
        other => {
            return Err(GgufError::Tokenizer(format!(
                "pre-tokenizer {other:?} (supported: smollm, gpt2)"
            )));
        }
    };
    let merges = meta.strings("tokenizer.ggml.merges")?;
    if types.len() != tokens.len() {
        return Err(GgufError::Tokenizer(format!(
            "{} token types for {} tokens",
            types.len(),
            tokens.len()
        )));
    }
    let vocab: serde_json::Map<String, serde_json::Value> = tokens
        .iter()
        .enumerate()
        .map(|(id, t)| ((*t).to_owned(), json!(id)))
        .collect();
    let added: Vec<serde_json::Value> = tokens
        .iter()
        .zip(types)
        .enumerate()
        .filter(|(_, (_, ty))| matches!(**ty, TOKEN_TYPE_CONTROL | TOKEN_TYPE_USER_DEFINED))
        .map(|(id, (t, _))| {
            json!({
                "id": id, "content": t, "single_word": false, "lstrip": false, "rstrip": false,
                "normalized": false, "special": true
            })
        })
        .collect();
    let byte_level_off = json!({
        "type": "ByteLevel", "add_prefix_space": false, "trim_offsets": false, "use_regex": false
    });
    Ok(json!({
        "version": "1.0",
        "truncation": null,
        "padding": null,
        "added_tokens": added,
        "normalizer": null,
        "pre_tokenizer": pre_tokenizer,
        "post_processor": byte_level_off,
        "decoder": byte_level_off,
        "model": {
            "type": "BPE", "dropout": null, "unk_token": null, "continuing_subword_prefix": null,
            "end_of_word_suffix": null, "fuse_unk": false, "byte_fallback": false,
            "ignore_merges": false, "vocab": vocab, "merges": merges,
        },
    }))
}

fn wrong_type(key: &str, want: &str, got: &Value) -> GgufError {
    let got = match got {
        Value::UInt(_) => "an unsigned integer",
        Value::Int(_) => "a signed integer",
        Value::Float(_) => "a float",
        Value::Bool(_) => "a bool",
        Value::Str(_) => "a string",
        Value::Array(_) => "an array",
    };
    GgufError::Key {
        key: key.into(),
        reason: format!("expected {want}, found {got}"),
    }
}

// === impl Reader ===

struct Reader<'a> {
    inner: BufReader<std::fs::File>,
    path: &'a Path,
}

impl Reader<'_> {
    fn format(&self, reason: &str) -> GgufError {
        GgufError::Format {
            path: self.path.to_owned(),
            reason: reason.into(),
        }
    }

    fn bytes(&mut self, out: &mut [u8]) -> Result<(), GgufError> {
        self.inner.read_exact(out).map_err(|source| GgufError::Io {
            path: self.path.to_owned(),
            source,
        })
    }

    fn array<const N: usize>(&mut self) -> Result<[u8; N], GgufError> {
        let mut b = [0; N];
        self.bytes(&mut b)?;
        Ok(b)
    }

    fn u32(&mut self) -> Result<u32, GgufError> {
        Ok(u32::from_le_bytes(self.array()?))
    }

    fn u64(&mut self) -> Result<u64, GgufError> {
        Ok(u64::from_le_bytes(self.array()?))
    }

    fn string(&mut self) -> Result<String, GgufError> {
        let len = self.u64()?;
        if len > MAX_STRING {
            return Err(self.format(&format!("a string of {len} bytes")));
        }
        let mut buf = vec![0; len as usize];
        self.bytes(&mut buf)?;
        String::from_utf8(buf).map_err(|_| self.format("a string that is not UTF-8"))
    }

    fn value(&mut self, kind: u32) -> Result<Value, GgufError> {
        Ok(match kind {
            0 => Value::UInt(u64::from(u8::from_le_bytes(self.array()?))),
            1 => Value::Int(i64::from(i8::from_le_bytes(self.array()?))),
            2 => Value::UInt(u64::from(u16::from_le_bytes(self.array()?))),
            3 => Value::Int(i64::from(i16::from_le_bytes(self.array()?))),
            4 => Value::UInt(u64::from(self.u32()?)),
            5 => Value::Int(i64::from(i32::from_le_bytes(self.array()?))),
            6 => Value::Float(f64::from(f32::from_le_bytes(self.array()?))),
            7 => Value::Bool(self.array::<1>()?[0] != 0),
            8 => Value::Str(self.string()?),
            9 => {
                let item = self.u32()?;
                let len = self.u64()?;
                if len > MAX_ARRAY || item == 9 {
                    return Err(self.format(&format!("an array of {len} items of type {item}")));
                }
                let items = (0..len)
                    .map(|_| self.value(item))
                    .collect::<Result<_, _>>()?;
                Value::Array(items)
            }
            10 => Value::UInt(self.u64()?),
            11 => Value::Int(i64::from_le_bytes(self.array()?)),
            12 => Value::Float(f64::from_le_bytes(self.array()?)),
            other => return Err(self.format(&format!("metadata value type {other}"))),
        })
    }
}

#[cfg(test)]
mod tests;
