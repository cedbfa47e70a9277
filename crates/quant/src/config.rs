//! The `quantization_config` of config.json, after compressed-tensors 0.20 `quantization/{quant_config,
//! quant_scheme,quant_args}.py`, `quantization/lifecycle/apply.py` and `utils/match.py`, and transformers'
//! `FineGrainedFP8Config` (`utils/quantization_config.py`, `quantizers/quantizers_utils.py`); summary in
//! `kimi-k2-formats.md` section 1.
//!
//! Two steps (STYLE rule 2): [`QuantizationConfig`] mirrors the JSON (a serde enum tagged by `quant_method`,
//! unknown fields kept), and [`QuantizationConfig::plan`] validates it into a [`QuantPlan`], which answers
//! [`QuantPlan::scheme_for`] a module with the same matching rules as compressed-tensors:
//!
//! 1. a module is skipped if any `ignore` entry matches it (`match_named_modules` / `is_match`): an entry
//!    `re:<pat>` is Python `re.match(pat, name)` (anchored at the start only, compiled here as `^(?:pat)`), any
//!    other entry must equal the module name *or* the module's class name (`_match_class`; vLLM's `LinearBase`
//!    also matches `Linear`);
//! 2. otherwise its scheme comes from the first matching target in the order of `match_targets`: targets sorted by
//!    `("re:" in target, target)`, name matches (exact, then regex) before class matches; when two groups list the
//!    same target string the later group wins (`target_to_scheme` is a dict filled in group order).
//!
//! Supported compressed-tensors schemes: `pack-quantized`, weights only, `type: int`, `num_bits: 4`, strategy
//! `group` or `channel` (one group spanning the row), static (`dynamic: false`), `actorder` null/false or `weight`
//! (`weight` only changes calibration, not the stored format: no `g_idx`), and the presets `W4A16`/`W4A16_ASYM`.

use std::collections::BTreeMap;
use std::fmt;
use std::path::Path;

use regex::Regex;
use serde::de::{MapAccess, Visitor};
use serde::ser::SerializeMap;
use serde::{Deserialize, Deserializer, Serialize, Serializer};
use serde_json::Value;

use crate::fp8::DEFAULT_BLOCK;
use crate::{QuantError, Result};

/// `quantization_config` as written in config.json, tagged by `quant_method`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "quant_method")]
pub enum QuantizationConfig {
    /// `"quant_method": "compressed-tensors"` (Kimi-K2-Thinking, Kimi-K2.5 INT4).
    #[serde(rename = "compressed-tensors")]
    CompressedTensors(Box<CompressedTensorsConfig>),
    /// `"quant_method": "fp8"` (DeepSeek-V3 and Kimi-K2-Instruct block FP8).
    #[serde(rename = "fp8")]
    Fp8(Fp8Config),
}

/// A compressed-tensors `QuantizationConfig` (plus the keys `ModelCompressor.update_config` adds).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct CompressedTensorsConfig {
    /// Scheme per group name, in document order when parsed from text.
    pub config_groups: ConfigGroups,
    /// Storage format: `pack-quantized` for INT4 (library default `fakequant`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub format: Option<String>,
    /// `compressed` for a checkpoint holding packed weights.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub quantization_status: Option<String>,
    /// Modules left unquantized: exact names, class names or `re:` patterns.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ignore: Option<Vec<String>>,
    /// KV-cache quantization (unsupported unless null).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub kv_cache_scheme: Option<QuantizationArgs>,
    /// Informational compression ratio.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub global_compression_ratio: Option<f64>,
    /// Sparsity compression (unsupported unless null or `{}`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub sparsity_config: Option<Value>,
    /// Weight transforms such as rotations (unsupported unless null or `{}`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub transform_config: Option<Value>,
    /// MoE expert sparsity (unsupported unless null).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub moe_sparsity_config: Option<Value>,
    /// The compressed-tensors version that wrote the config.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub version: Option<String>,
    /// Any other key, kept as is.
    #[serde(flatten)]
    pub extra: BTreeMap<String, Value>,
}

/// `config_groups`: an ordered map from group name to scheme. Parsed from text it keeps document order (which
/// decides between groups listing the same target); parsed from a [`serde_json::Value`] it is in key order.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct ConfigGroups(pub Vec<(String, ConfigGroup)>);

/// One entry of `config_groups`: a full scheme, or a list of targets for a preset named by the group.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(untagged)]
pub enum ConfigGroup {
    /// `{targets, weights, input_activations, output_activations, format}`.
    Scheme(Box<QuantizationSchemeConfig>),
    /// Targets of the preset scheme named by the group key (`"W4A16": ["Linear"]`).
    Preset(Vec<String>),
}

/// A compressed-tensors `QuantizationScheme`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct QuantizationSchemeConfig {
    /// Module names, class names (`Linear`) or `re:` patterns.
    pub targets: Vec<String>,
    /// Weight quantization.
    #[serde(default)]
    pub weights: Option<QuantizationArgs>,
    /// Input activation quantization (null for weight-only schemes).
    #[serde(default)]
    pub input_activations: Option<QuantizationArgs>,
    /// Output activation quantization (null for weight-only schemes).
    #[serde(default)]
    pub output_activations: Option<QuantizationArgs>,
    /// Per-group storage format, overriding the top-level `format`.
    #[serde(default)]
    pub format: Option<String>,
    /// Any other key, kept as is.
    #[serde(flatten)]
    pub extra: BTreeMap<String, Value>,
}

/// A compressed-tensors `QuantizationArgs`; defaults are the library's.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct QuantizationArgs {
    /// Bits per value (default 8).
    #[serde(default = "default_num_bits")]
    pub num_bits: u32,
    /// `int` or `float` (default `int`, compared case-insensitively).
    #[serde(default = "default_type")]
    pub r#type: String,
    /// Symmetric (no zero point), default true.
    #[serde(default = "default_true")]
    pub symmetric: bool,
    /// `tensor`, `channel`, `group`, `block`, `token`, `tensor_group`, `attn_head`; inferred from `group_size`
    /// when absent (none: `tensor`, > 0: `group`, -1: `channel`).
    #[serde(default)]
    pub strategy: Option<String>,
    /// Columns per group (`group` strategy), -1 for `channel`.
    #[serde(default)]
    pub group_size: Option<i64>,
    /// `false`/`true`, or `"local"`.
    #[serde(default = "default_dynamic")]
    pub dynamic: BoolOrString,
    /// Calibration observer (`minmax`, ...), informational.
    #[serde(default)]
    pub observer: Option<String>,
    /// Activation ordering: null, `false`, `"weight"`/`"static"` or the removed `"group"`/`"dynamic"`.
    #[serde(default)]
    pub actorder: Option<BoolOrString>,
    /// `[rows, cols]` (or `"RxC"`) for the `block` strategy.
    #[serde(default)]
    pub block_structure: Option<Value>,
    /// Any other key (`observer_kwargs`, `scale_dtype`, `zp_dtype`, ...), kept as is.
    #[serde(flatten)]
    pub extra: BTreeMap<String, Value>,
}

/// A JSON value that is either a boolean or a string (`dynamic`, `actorder`).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(untagged)]
pub enum BoolOrString {
    /// `true` / `false`.
    Bool(bool),
    /// A string such as `"local"` or `"weight"`.
    String(String),
}

impl fmt::Display for BoolOrString {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            BoolOrString::Bool(b) => write!(f, "{b}"),
            BoolOrString::String(s) => write!(f, "{s:?}"),
        }
    }
}

/// The block-FP8 `quantization_config` of DeepSeek-V3 / Kimi-K2-Instruct (transformers `FineGrainedFP8Config`).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Fp8Config {
    /// FP8 encoding of the weights (`e4m3`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub fmt: Option<String>,
    /// `dynamic` (per-token activation scales computed at run time).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub activation_scheme: Option<String>,
    /// `[rows, cols]` of a scale block, default `[128, 128]`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub weight_block_size: Option<Vec<usize>>,
    /// Modules kept in high precision (transformers also reads `ignored_layers`).
    #[serde(default, alias = "ignored_layers", skip_serializing_if = "Option::is_none")]
    pub modules_to_not_convert: Option<Vec<String>>,
    /// Any other key, kept as is.
    #[serde(flatten)]
    pub extra: BTreeMap<String, Value>,
}

fn default_num_bits() -> u32 {
    8
}

fn default_type() -> String {
    "int".to_owned()
}

fn default_true() -> bool {
    true
}

fn default_dynamic() -> BoolOrString {
    BoolOrString::Bool(false)
}

impl Serialize for ConfigGroups {
    fn serialize<S: Serializer>(&self, serializer: S) -> std::result::Result<S::Ok, S::Error> {
        let mut map = serializer.serialize_map(Some(self.0.len()))?;
        for (name, group) in &self.0 {
            map.serialize_entry(name, group)?;
        }
        map.end()
    }
}

impl<'de> Deserialize<'de> for ConfigGroups {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> std::result::Result<Self, D::Error> {
        struct GroupsVisitor;
        impl<'de> Visitor<'de> for GroupsVisitor {
            type Value = ConfigGroups;
            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str("a map from group name to quantization scheme")
            }
            fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> std::result::Result<ConfigGroups, A::Error> {
                let mut groups = Vec::with_capacity(map.size_hint().unwrap_or(0));
                while let Some((name, group)) = map.next_entry::<String, ConfigGroup>()? {
                    groups.push((name, group));
                }
                Ok(ConfigGroups(groups))
            }
        }
        deserializer.deserialize_map(GroupsVisitor)
    }
}

/// The validated form of one quantization scheme.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum QuantScheme {
    /// compressed-tensors `pack-quantized` INT4 weights, scales per group of input columns.
    Int4Group {
        /// Columns per group.
        group_size: GroupSize,
        /// No zero points when true.
        symmetric: bool,
    },
    /// Block-scaled FP8 E4M3 weights with `weight_scale_inv` per `block` (rows, cols).
    Fp8Block {
        /// `(rows, cols)` of one scale block, `(128, 128)` in DeepSeek-V3 / Kimi-K2.
        block: (usize, usize),
    },
}

/// The group width of an INT4 scheme.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum GroupSize {
    /// `strategy: group`: this many consecutive input columns share a scale (the last group may be shorter).
    Columns(usize),
    /// `strategy: channel`: one scale per output row.
    WholeRow,
}

impl GroupSize {
    /// The number of columns per group for a Linear with `in_features` inputs (`in_features` for a whole row).
    pub fn columns(self, in_features: usize) -> usize {
        match self {
            GroupSize::Columns(n) => n,
            GroupSize::WholeRow => in_features,
        }
    }
}

/// A module-name pattern: `re:` entries are regexes anchored at the start, others are compared whole.
#[derive(Debug, Clone)]
enum NamePattern {
    Exact(String),
    Regex(Regex),
}

impl NamePattern {
    /// Compiles an `ignore`/`targets` entry; `field` names the config field for errors.
    fn compile(entry: &str, field: &str) -> Result<Self> {
        match entry.strip_prefix("re:") {
            Some(pattern) => Regex::new(&format!("^(?:{pattern})")).map(NamePattern::Regex).map_err(|e| {
                QuantError::BadPattern { field: field.to_owned(), pattern: pattern.to_owned(), message: e.to_string() }
            }),
            None => Ok(NamePattern::Exact(entry.to_owned())),
        }
    }

    /// compressed-tensors `match_name`.
    fn matches_name(&self, name: &str) -> bool {
        match self {
            NamePattern::Exact(s) => s == name,
            NamePattern::Regex(re) => re.is_match(name),
        }
    }

    /// compressed-tensors `_match_class` for a module whose class is `class_name` (a regex never matches).
    fn matches_class(&self, class_name: &str) -> bool {
        match self {
            NamePattern::Exact(s) => s == class_name || (class_name == "LinearBase" && s == "Linear"),
            NamePattern::Regex(_) => false,
        }
    }

    fn matches(&self, name: &str, class_name: &str) -> bool {
        self.matches_name(name) || self.matches_class(class_name)
    }
}

/// A validated `quantization_config`: which scheme, if any, applies to each module.
#[derive(Debug, Clone)]
pub struct QuantPlan {
    rules: Rules,
}

#[derive(Debug, Clone)]
enum Rules {
    CompressedTensors {
        ignore: Vec<NamePattern>,
        /// Distinct targets sorted as `match_targets` sorts them, each with the scheme of the last group listing it.
        targets: Vec<(NamePattern, QuantScheme)>,
    },
    Fp8 {
        scheme: QuantScheme,
        not_convert: Vec<String>,
    },
}

impl QuantPlan {
    /// The scheme applying to the module `module_name` (full dotted name, e.g. `model.layers.1.mlp.experts.0.
    /// gate_proj`) of Python class `class_name` (`Linear` for every `nn.Linear`), or `None` if it is not quantized.
    ///
    /// compressed-tensors: `ignore` first (name or class), then the targets (see the module docs). FP8: every
    /// `Linear` except `lm_head` (transformers always keeps the output embedding) and `modules_to_not_convert`
    /// (transformers' `should_convert_module`: a prefix ending at a module boundary, or a suffix). The FP8 config
    /// lists no other exceptions: DeepSeek-V3's router is class `MoEGate`, not `Linear`.
    pub fn scheme_for(&self, module_name: &str, class_name: &str) -> Option<&QuantScheme> {
        match &self.rules {
            Rules::CompressedTensors { ignore, targets } => {
                if ignore.iter().any(|p| p.matches(module_name, class_name)) {
                    return None;
                }
                targets
                    .iter()
                    .find(|(p, _)| p.matches_name(module_name))
                    .or_else(|| targets.iter().find(|(p, _)| p.matches_class(class_name)))
                    .map(|(_, scheme)| scheme)
            }
            Rules::Fp8 { scheme, not_convert } => {
                let is_linear = class_name == "Linear" || class_name == "LinearBase";
                let kept = module_name == "lm_head"
                    || module_name.ends_with(".lm_head")
                    || not_convert.iter().any(|key| hf_not_convert_matches(key, module_name));
                (is_linear && !kept).then_some(scheme)
            }
        }
    }

    /// Every distinct scheme of the plan.
    pub fn schemes(&self) -> Vec<QuantScheme> {
        let mut out: Vec<QuantScheme> = Vec::new();
        let all: Vec<QuantScheme> = match &self.rules {
            Rules::CompressedTensors { targets, .. } => targets.iter().map(|(_, s)| *s).collect(),
            Rules::Fp8 { scheme, .. } => vec![*scheme],
        };
        for s in all {
            if !out.contains(&s) {
                out.push(s);
            }
        }
        out
    }
}

/// transformers' `should_convert_module` test for one literal key: the key names a prefix of `name` ending at a
/// module boundary (`layer.1` matches `layer.1.attn`, not `layer.11.attn`), or is a suffix of `name`.
fn hf_not_convert_matches(key: &str, name: &str) -> bool {
    name.ends_with(key) || name.strip_prefix(key).is_some_and(|rest| rest.is_empty() || rest.starts_with('.'))
}

impl QuantizationConfig {
    /// Finds and parses the `quantization_config` of a model's config.json: at the top level, else in
    /// `text_config.quantization_config` (Kimi-K2.5). `Ok(None)` when neither exists (or both are null).
    pub fn from_model_config(config: &Value) -> Result<Option<Self>> {
        Self::from_model_config_at(config, Path::new("config.json"))
    }

    /// Reads config.json at `path` and calls [`QuantizationConfig::from_model_config`].
    pub fn from_config_file(path: &Path) -> Result<Option<Self>> {
        let text = std::fs::read_to_string(path).map_err(|e| QuantError::io(path, e))?;
        let value: Value = serde_json::from_str(&text).map_err(|e| QuantError::Json {
            path: path.to_owned(),
            field: None,
            message: e.to_string(),
        })?;
        Self::from_model_config_at(&value, path)
    }

    fn from_model_config_at(config: &Value, path: &Path) -> Result<Option<Self>> {
        let (field, value) = match config.get("quantization_config").filter(|v| !v.is_null()) {
            Some(v) => ("quantization_config", v),
            None => match config.get("text_config").and_then(|t| t.get("quantization_config")).filter(|v| !v.is_null())
            {
                Some(v) => ("text_config.quantization_config", v),
                None => return Ok(None),
            },
        };
        Self::deserialize(value).map(Some).map_err(|e| QuantError::Json {
            path: path.to_owned(),
            field: Some(field.to_owned()),
            message: e.to_string(),
        })
    }

    /// Validates the config into a [`QuantPlan`]: every group must be a supported scheme and every `re:` pattern
    /// must compile. Errors name the dotted field at fault (`config_groups.group_0.weights.num_bits`).
    pub fn plan(&self) -> Result<QuantPlan> {
        match self {
            QuantizationConfig::CompressedTensors(c) => c.plan(),
            QuantizationConfig::Fp8(c) => c.plan(),
        }
    }
}

fn unsupported(field: impl Into<String>, message: impl Into<String>) -> QuantError {
    QuantError::UnsupportedScheme { field: Some(field.into()), message: message.into() }
}

fn is_empty_or_null(v: &Option<Value>) -> bool {
    match v {
        None | Some(Value::Null) => true,
        Some(Value::Object(m)) => m.is_empty(),
        Some(_) => false,
    }
}

impl CompressedTensorsConfig {
    /// Validates the config into a [`QuantPlan`] (see [`QuantizationConfig::plan`]).
    pub fn plan(&self) -> Result<QuantPlan> {
        if let Some(status) = &self.quantization_status
            && status != "compressed"
        {
            return Err(unsupported("quantization_status", format!("{status:?} (only \"compressed\" checkpoints)")));
        }
        if self.kv_cache_scheme.is_some() {
            return Err(unsupported("kv_cache_scheme", "KV-cache quantization is not supported"));
        }
        for (field, value) in [
            ("sparsity_config", &self.sparsity_config),
            ("transform_config", &self.transform_config),
            ("moe_sparsity_config", &self.moe_sparsity_config),
        ] {
            if !is_empty_or_null(value) {
                return Err(unsupported(field, "must be null or {}: sparsity and transforms are not supported"));
            }
        }
        let ignore = self
            .ignore
            .iter()
            .flatten()
            .map(|entry| NamePattern::compile(entry, "ignore"))
            .collect::<Result<Vec<_>>>()?;

        // target -> (scheme, pattern); a later group overwrites an identical target, like the Python dict.
        let mut by_target: BTreeMap<&str, (QuantScheme, NamePattern)> = BTreeMap::new();
        for (name, group) in &self.config_groups.0 {
            let (scheme, targets) = self.validate_group(name, group)?;
            for target in targets {
                let pattern = NamePattern::compile(target, &format!("config_groups.{name}.targets"))?;
                by_target.insert(target, (scheme, pattern));
            }
        }
        let mut sorted: Vec<(&str, (QuantScheme, NamePattern))> = by_target.into_iter().collect();
        sorted.sort_by(|(a, _), (b, _)| (a.contains("re:"), a).cmp(&(b.contains("re:"), b)));
        let targets = sorted.into_iter().map(|(_, (scheme, pattern))| (pattern, scheme)).collect();
        Ok(QuantPlan { rules: Rules::CompressedTensors { ignore, targets } })
    }

    /// Validates one group, returning its scheme and targets.
    fn validate_group<'a>(&self, name: &str, group: &'a ConfigGroup) -> Result<(QuantScheme, &'a [String])> {
        let field = format!("config_groups.{name}");
        let scheme = match group {
            ConfigGroup::Preset(targets) => {
                self.check_format(None, &field)?;
                let symmetric = match name.to_ascii_uppercase().as_str() {
                    "W4A16" => true,
                    "W4A16_ASYM" => false,
                    other => {
                        return Err(unsupported(field, format!("preset {other:?} (only W4A16 and W4A16_ASYM)")));
                    }
                };
                return Ok((QuantScheme::Int4Group { group_size: GroupSize::Columns(128), symmetric }, targets));
            }
            ConfigGroup::Scheme(s) => s,
        };
        self.check_format(scheme.format.as_deref(), &field)?;
        if scheme.input_activations.is_some() {
            return Err(unsupported(format!("{field}.input_activations"), "activation quantization (must be null)"));
        }
        if scheme.output_activations.is_some() {
            return Err(unsupported(format!("{field}.output_activations"), "activation quantization (must be null)"));
        }
        let w = scheme.weights.as_ref().ok_or_else(|| unsupported(format!("{field}.weights"), "missing (null)"))?;
        let wf = format!("{field}.weights");
        if w.num_bits != 4 {
            return Err(unsupported(format!("{wf}.num_bits"), format!("{} (only 4)", w.num_bits)));
        }
        if !w.r#type.eq_ignore_ascii_case("int") {
            return Err(unsupported(format!("{wf}.type"), format!("{:?} (only \"int\")", w.r#type)));
        }
        if w.dynamic != BoolOrString::Bool(false) {
            return Err(unsupported(format!("{wf}.dynamic"), format!("{} (only false)", w.dynamic)));
        }
        match &w.actorder {
            None | Some(BoolOrString::Bool(false)) => {}
            Some(BoolOrString::String(s)) if s.eq_ignore_ascii_case("weight") || s.eq_ignore_ascii_case("static") => {}
            Some(other) => {
                return Err(unsupported(
                    format!("{wf}.actorder"),
                    format!("{other} (only null, false or \"weight\": group ordering needs g_idx)"),
                ));
            }
        }
        if w.block_structure.as_ref().is_some_and(|b| !b.is_null()) {
            return Err(unsupported(format!("{wf}.block_structure"), "block strategy (only group or channel)"));
        }
        let strategy = match (&w.strategy, w.group_size) {
            (Some(s), _) => s.to_ascii_lowercase(),
            (None, None) => "tensor".to_owned(),
            (None, Some(-1)) => "channel".to_owned(),
            (None, Some(_)) => "group".to_owned(),
        };
        let group_size = match (strategy.as_str(), w.group_size) {
            ("group", Some(g)) if g > 0 => GroupSize::Columns(
                usize::try_from(g).map_err(|_| unsupported(format!("{wf}.group_size"), format!("{g} is too large")))?,
            ),
            ("group", g) => {
                let shown = g.map_or("null".to_owned(), |g| g.to_string());
                return Err(unsupported(format!("{wf}.group_size"), format!("{shown} (group strategy needs > 0)")));
            }
            ("channel", None | Some(-1)) => GroupSize::WholeRow,
            ("channel", Some(g)) => {
                return Err(unsupported(
                    format!("{wf}.group_size"),
                    format!("{g} (channel strategy needs null or -1)"),
                ));
            }
            (other, _) => {
                return Err(unsupported(
                    format!("{wf}.strategy"),
                    format!("{other:?} (only \"group\" or \"channel\")"),
                ));
            }
        };
        Ok((QuantScheme::Int4Group { group_size, symmetric: w.symmetric }, &scheme.targets))
    }

    /// The group's format, else the top-level one, must be `pack-quantized`.
    fn check_format(&self, group_format: Option<&str>, group_field: &str) -> Result<()> {
        let (field, format) = match group_format {
            Some(f) => (format!("{group_field}.format"), Some(f)),
            None => ("format".to_owned(), self.format.as_deref()),
        };
        match format {
            Some("pack-quantized") => Ok(()),
            Some(other) => Err(unsupported(field, format!("{other:?} (only \"pack-quantized\")"))),
            None => Err(unsupported(field, "missing (only \"pack-quantized\")")),
        }
    }
}

impl Fp8Config {
    /// Validates the config into a [`QuantPlan`] (see [`QuantizationConfig::plan`]).
    pub fn plan(&self) -> Result<QuantPlan> {
        if let Some(fmt) = &self.fmt
            && fmt != "e4m3"
        {
            return Err(unsupported("fmt", format!("{fmt:?} (only \"e4m3\")")));
        }
        if let Some(scheme) = &self.activation_scheme
            && !scheme.eq_ignore_ascii_case("dynamic")
        {
            return Err(unsupported("activation_scheme", format!("{scheme:?} (only \"dynamic\")")));
        }
        let block = match self.weight_block_size.as_deref() {
            None => DEFAULT_BLOCK,
            Some(&[rows, cols]) if rows > 0 && cols > 0 => (rows, cols),
            Some(other) => {
                return Err(unsupported("weight_block_size", format!("{other:?} (two positive sizes)")));
            }
        };
        Ok(QuantPlan {
            rules: Rules::Fp8 {
                scheme: QuantScheme::Fp8Block { block },
                not_convert: self.modules_to_not_convert.clone().unwrap_or_default(),
            },
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    /// The compressed-tensors config of Kimi-K2-Thinking / K2.5, field for field from `kimi-k2-formats.md` §1.
    fn kimi_quantization_config() -> Value {
        json!({
            "quant_method": "compressed-tensors",
            "format": "pack-quantized",
            "quantization_status": "compressed",
            "config_groups": {
                "group_0": {
                    "targets": ["Linear"],
                    "input_activations": null,
                    "output_activations": null,
                    "weights": {
                        "num_bits": 4,
                        "type": "int",
                        "symmetric": true,
                        "strategy": "group",
                        "group_size": 32,
                        "dynamic": false,
                        "observer": "minmax",
                        "actorder": null
                    }
                }
            },
            "ignore": ["lm_head", "re:.*self_attn.*", "re:.*shared_experts.*", "re:.*mlp\\.(gate|up|gate_up|down)_proj.*"]
        })
    }

    const INT4_32: QuantScheme = QuantScheme::Int4Group { group_size: GroupSize::Columns(32), symmetric: true };

    fn check_kimi_plan(plan: &QuantPlan, prefix: &str) {
        let scheme = |m: &str| plan.scheme_for(&format!("{prefix}{m}"), "Linear").copied();
        for e in ["mlp.experts.0.gate_proj", "mlp.experts.17.up_proj", "mlp.experts.383.down_proj"] {
            assert_eq!(scheme(&format!("model.layers.1.{e}")), Some(INT4_32), "{e}");
            assert_eq!(scheme(&format!("model.layers.60.{e}")), Some(INT4_32), "{e}");
        }
        for m in [
            "model.layers.0.mlp.gate_proj",
            "model.layers.0.mlp.down_proj",
            "model.layers.3.mlp.shared_experts.gate_proj",
            "model.layers.3.mlp.shared_experts.down_proj",
            "model.layers.3.self_attn.q_a_proj",
            "model.layers.3.self_attn.kv_b_proj",
            "model.layers.3.self_attn.o_proj",
        ] {
            assert_eq!(scheme(m), None, "{m}");
        }
        assert_eq!(plan.scheme_for("lm_head", "Linear"), None);
        // `lm_head` is an exact name: with a prefix (K2.5's `language_model.lm_head`) it is *not* ignored, as in
        // compressed-tensors; such a checkpoint simply has no `weight_packed` for it.
        if !prefix.is_empty() {
            assert_eq!(scheme("lm_head"), Some(INT4_32));
        }
        // Not a Linear: nothing targets it.
        assert_eq!(plan.scheme_for(&format!("{prefix}model.layers.1.mlp.gate"), "MoEGate"), None);
        assert_eq!(plan.scheme_for(&format!("{prefix}model.embed_tokens"), "Embedding"), None);
    }

    #[test]
    fn kimi_config_top_level_and_text_config() {
        let top = json!({"model_type": "kimi_k2", "quantization_config": kimi_quantization_config()});
        let nested =
            json!({"model_type": "kimi_k25", "text_config": {"quantization_config": kimi_quantization_config()}});
        for config in [&top, &nested] {
            let parsed = QuantizationConfig::from_model_config(config).unwrap().unwrap();
            let QuantizationConfig::CompressedTensors(ct) = &parsed else { panic!("wrong variant: {parsed:?}") };
            assert_eq!(ct.format.as_deref(), Some("pack-quantized"));
            assert_eq!(ct.ignore.as_ref().map(Vec::len), Some(4));
            let plan = parsed.plan().unwrap();
            check_kimi_plan(&plan, "");
            assert_eq!(plan.schemes(), vec![INT4_32]);
        }
        // K2.5 names its text weights `language_model.model.*`: the ignore regexes still apply (`.*` prefix).
        let plan = QuantizationConfig::from_model_config(&nested).unwrap().unwrap().plan().unwrap();
        check_kimi_plan(&plan, "language_model.");
        assert_eq!(QuantizationConfig::from_model_config(&json!({"model_type": "llama"})).unwrap(), None);
    }

    #[test]
    fn unknown_fields_are_kept_and_round_trip() {
        let mut q = kimi_quantization_config();
        q["version"] = json!("0.20.1");
        q["sparsity_config"] = json!({});
        q["future_key"] = json!([1, 2]);
        q["config_groups"]["group_0"]["weights"]["observer_kwargs"] = json!({});
        let parsed = QuantizationConfig::deserialize(&q).unwrap();
        let QuantizationConfig::CompressedTensors(ct) = &parsed else { panic!() };
        assert_eq!(ct.version.as_deref(), Some("0.20.1"));
        assert_eq!(ct.extra.get("future_key"), Some(&json!([1, 2])));
        let again = QuantizationConfig::deserialize(&serde_json::to_value(&parsed).unwrap()).unwrap();
        assert_eq!(again, parsed);
        parsed.plan().unwrap();
    }

    fn plan_error(edit: impl FnOnce(&mut Value)) -> QuantError {
        let mut q = kimi_quantization_config();
        edit(&mut q);
        QuantizationConfig::deserialize(&q).unwrap().plan().unwrap_err()
    }

    fn unsupported_field(e: QuantError) -> String {
        match e {
            QuantError::UnsupportedScheme { field: Some(f), .. } => f,
            other => panic!("expected UnsupportedScheme, got {other:?}"),
        }
    }

    #[test]
    fn unsupported_schemes_name_the_field_and_value() {
        let e = plan_error(|q| q["config_groups"]["group_0"]["weights"]["num_bits"] = json!(8));
        assert_eq!(e.to_string(), "quantization_config.config_groups.group_0.weights.num_bits: 8 (only 4)");
        let w = |key: &'static str, v: Value| move |q: &mut Value| q["config_groups"]["group_0"]["weights"][key] = v;
        type Edit = Box<dyn FnOnce(&mut Value)>;
        let cases: Vec<(Edit, &str)> = vec![
            (Box::new(w("type", json!("float"))), "config_groups.group_0.weights.type"),
            (Box::new(w("strategy", json!("tensor"))), "config_groups.group_0.weights.strategy"),
            (Box::new(w("group_size", json!(null))), "config_groups.group_0.weights.group_size"),
            (Box::new(w("dynamic", json!(true))), "config_groups.group_0.weights.dynamic"),
            (Box::new(w("actorder", json!("group"))), "config_groups.group_0.weights.actorder"),
            (
                Box::new(|q: &mut Value| q["config_groups"]["group_0"]["input_activations"] = json!({"num_bits": 8})),
                "config_groups.group_0.input_activations",
            ),
            (Box::new(|q: &mut Value| q["format"] = json!("float-quantized")), "format"),
            (Box::new(|q: &mut Value| q["quantization_status"] = json!("frozen")), "quantization_status"),
            (Box::new(|q: &mut Value| q["kv_cache_scheme"] = json!({"num_bits": 8})), "kv_cache_scheme"),
            (Box::new(|q: &mut Value| q["transform_config"] = json!({"config_groups": {}})), "transform_config"),
            (
                Box::new(|q: &mut Value| q["config_groups"]["group_0"]["weights"] = json!(null)),
                "config_groups.group_0.weights",
            ),
        ];
        for (edit, field) in cases {
            assert_eq!(unsupported_field(plan_error(edit)), field);
        }
    }

    #[test]
    fn channel_strategy_and_presets() {
        let mut q = kimi_quantization_config();
        q["config_groups"]["group_0"]["weights"]["strategy"] = json!("channel");
        q["config_groups"]["group_0"]["weights"]["group_size"] = json!(null);
        q["config_groups"]["group_0"]["weights"]["symmetric"] = json!(false);
        q["config_groups"]["group_0"]["weights"]["actorder"] = json!("weight");
        let plan = QuantizationConfig::deserialize(&q).unwrap().plan().unwrap();
        let s = plan.scheme_for("model.layers.1.mlp.experts.0.up_proj", "Linear").copied();
        assert_eq!(s, Some(QuantScheme::Int4Group { group_size: GroupSize::WholeRow, symmetric: false }));
        assert_eq!(GroupSize::WholeRow.columns(7168), 7168);

        let preset = json!({"quant_method": "compressed-tensors", "format": "pack-quantized",
            "config_groups": {"W4A16_ASYM": ["Linear"]}});
        let plan = QuantizationConfig::deserialize(&preset).unwrap().plan().unwrap();
        let s = plan.scheme_for("x", "Linear").copied();
        assert_eq!(s, Some(QuantScheme::Int4Group { group_size: GroupSize::Columns(128), symmetric: false }));
        let bad = json!({"quant_method": "compressed-tensors", "format": "pack-quantized",
            "config_groups": {"FP8": ["Linear"]}});
        let e = QuantizationConfig::deserialize(&bad).unwrap().plan().unwrap_err();
        assert_eq!(unsupported_field(e), "config_groups.FP8");
    }

    #[test]
    fn regex_is_python_re_match_anchored_at_the_start_only() {
        let q = json!({"quant_method": "compressed-tensors", "format": "pack-quantized",
            "config_groups": {"g": {"targets": ["Linear"], "weights": {"num_bits": 4, "group_size": 32}}},
            "ignore": ["re:model\\.layers\\.1\\.", "re:.*o_proj$", "Embedding"]});
        let plan = QuantizationConfig::deserialize(&q).unwrap().plan().unwrap();
        // Prefix match, the end is free.
        assert_eq!(plan.scheme_for("model.layers.1.mlp.experts.0.up_proj", "Linear"), None);
        // Anchored at the start: `layers.1.` in the middle of the name does not match.
        assert!(plan.scheme_for("language_model.model.layers.1.mlp.up_proj", "Linear").is_some());
        assert!(plan.scheme_for("model.layers.10.mlp.up_proj", "Linear").is_some());
        assert_eq!(plan.scheme_for("model.layers.2.self_attn.o_proj", "Linear"), None);
        // A non-regex ignore entry also matches the class name.
        assert_eq!(plan.scheme_for("model.layers.2.foo", "Embedding"), None);
        // vLLM's LinearBase matches the `Linear` target.
        assert!(plan.scheme_for("model.layers.2.mlp.up_proj", "LinearBase").is_some());
        assert_eq!(plan.scheme_for("model.layers.2.norm", "RMSNorm"), None);
    }

    #[test]
    fn target_priority_exact_then_regex_then_class_and_later_group_wins() {
        let args = |g: u32| json!({"num_bits": 4, "strategy": "group", "group_size": g});
        let q = json!({"quant_method": "compressed-tensors", "format": "pack-quantized", "config_groups": {
            "a": {"targets": ["Linear"], "weights": args(32)},
            "b": {"targets": ["re:.*experts\\.1\\..*", "re:.*experts.*"], "weights": args(64)},
            "c": {"targets": ["model.experts.1.up_proj"], "weights": args(128)},
            "d": {"targets": ["re:.*experts.*"], "weights": args(16)}
        }});
        let text = serde_json::to_string(&q).unwrap();
        let parsed: QuantizationConfig = serde_json::from_str(&text).unwrap();
        let plan = parsed.plan().unwrap();
        let g = |name: &str| match plan.scheme_for(name, "Linear") {
            Some(QuantScheme::Int4Group { group_size: GroupSize::Columns(n), .. }) => *n,
            other => panic!("{name}: {other:?}"),
        };
        assert_eq!(g("model.experts.1.up_proj"), 128); // exact name
        // Regexes sorted: `re:.*experts.*` (group d wins the duplicate) sorts before `re:.*experts\.1\..*`.
        assert_eq!(g("model.experts.1.down_proj"), 16);
        assert_eq!(g("model.experts.2.down_proj"), 16);
        assert_eq!(g("model.mlp.up_proj"), 32); // class
    }

    #[test]
    fn invalid_regex_is_bad_pattern() {
        let mut q = kimi_quantization_config();
        q["ignore"] = json!(["re:(unclosed"]);
        match QuantizationConfig::deserialize(&q).unwrap().plan().unwrap_err() {
            QuantError::BadPattern { field, pattern, .. } => {
                assert_eq!(field, "ignore");
                assert_eq!(pattern, "(unclosed");
            }
            other => panic!("{other:?}"),
        }
        let mut q = kimi_quantization_config();
        q["config_groups"]["group_0"]["targets"] = json!(["re:[z-a]"]);
        match QuantizationConfig::deserialize(&q).unwrap().plan().unwrap_err() {
            QuantError::BadPattern { field, .. } => assert_eq!(field, "config_groups.group_0.targets"),
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn malformed_config_is_a_json_error_naming_the_field() {
        let e = QuantizationConfig::from_model_config(&json!({"quantization_config": {"quant_method": "gptq"}}));
        match e.unwrap_err() {
            QuantError::Json { field, .. } => assert_eq!(field.as_deref(), Some("quantization_config")),
            other => panic!("{other:?}"),
        }
        let e =
            QuantizationConfig::from_model_config(&json!({"text_config": {"quantization_config": {"fmt": "e4m3"}}}));
        match e.unwrap_err() {
            QuantError::Json { field, .. } => assert_eq!(field.as_deref(), Some("text_config.quantization_config")),
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn fp8_block_config() {
        // Kimi-K2-Instruct / DeepSeek-V3 config.json.
        let config = json!({"quantization_config": {
            "activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8", "weight_block_size": [128, 128]}});
        let parsed = QuantizationConfig::from_model_config(&config).unwrap().unwrap();
        let QuantizationConfig::Fp8(fp8) = &parsed else { panic!("{parsed:?}") };
        assert_eq!(fp8.weight_block_size.as_deref(), Some(&[128, 128][..]));
        let plan = parsed.plan().unwrap();
        let fp8_block = Some(&QuantScheme::Fp8Block { block: (128, 128) });
        assert_eq!(plan.scheme_for("model.layers.3.self_attn.q_a_proj", "Linear"), fp8_block);
        assert_eq!(plan.scheme_for("model.layers.3.mlp.experts.5.down_proj", "Linear"), fp8_block);
        assert_eq!(plan.scheme_for("lm_head", "Linear"), None);
        assert_eq!(plan.scheme_for("model.layers.3.mlp.gate", "MoEGate"), None);

        let config = json!({"quant_method": "fp8", "ignored_layers": ["model.layers.1", "o_proj"]});
        let plan = QuantizationConfig::deserialize(&config).unwrap().plan().unwrap();
        assert_eq!(plan.scheme_for("model.layers.1.mlp.up_proj", "Linear"), None);
        assert!(plan.scheme_for("model.layers.11.mlp.up_proj", "Linear").is_some());
        assert_eq!(plan.scheme_for("model.layers.2.self_attn.o_proj", "Linear"), None);

        let bad = json!({"quant_method": "fp8", "weight_block_size": [128]});
        let e = QuantizationConfig::deserialize(&bad).unwrap().plan().unwrap_err();
        assert_eq!(unsupported_field(e), "weight_block_size");
        let bad = json!({"quant_method": "fp8", "fmt": "e5m2"});
        assert_eq!(unsupported_field(QuantizationConfig::deserialize(&bad).unwrap().plan().unwrap_err()), "fmt");
    }
}
