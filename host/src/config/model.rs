//! The `model` section: an ordered list of named layers (cuda-convnet's
//! layer-config idea), checked and with every layer's shape inferred.
//!
//! [`ModelConfig`] is the JSON as written. [`ModelSpec`] is what validation
//! makes of it: each [`LayerSpec`] carries its input and output shape
//! (C, H, W per sample, PyTorch's floor rule for output sizes), so the model
//! can allocate everything up front and no shape problem is left to surface
//! on the GPU. Parameter names and layouts follow PyTorch — `conv1.weight`
//! `[out, in/groups, kh, kw]`, `fc6.weight` `[out, in]` with `in` in (C, H, W)
//! flatten order — which is also what checkpoints store.

use std::fmt;

use serde::de::{Error as _, MapAccess, Visitor};
use serde::ser::{Error as _, SerializeMap};
use serde::{Deserialize, Deserializer, Serialize, Serializer};
use serde_json::Value;

use super::error::{Invalid, invalid, require};
use crate::backend::{ConvGeom, FcGeom, LrnParams, PoolGeom};

/// The `model` section as written in the file.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ModelConfig {
    pub input: InputShape,
    pub classes: usize,
    pub layers: Vec<LayerConfig>,
}

/// `model.input`: the shape of one sample as the network sees it (after
/// cropping).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct InputShape {
    pub channels: usize,
    pub height: usize,
    pub width: usize,
}

/// One entry of `model.layers`: `{"name": "conv1", "type": "conv", …}`, the
/// name next to the type's parameters in one flat object.
#[derive(Clone, Debug, PartialEq)]
pub struct LayerConfig {
    pub name: String,
    pub kind: LayerKind,
}

/// A layer's type and parameters (the JSON `type` field selects the variant).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(tag = "type", rename_all = "lowercase", deny_unknown_fields)]
pub enum LayerKind {
    Conv(ConvLayer),
    Relu,
    Lrn(LrnLayer),
    MaxPool(PoolLayer),
    Fc(FcLayer),
    Dropout(DropoutLayer),
    /// Softmax fused with the cross-entropy loss; must be the last layer.
    Softmax,
}

/// `"type": "conv"`: a square-kernel convolution with zero padding.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ConvLayer {
    pub filters: usize,
    /// Kernel height and width.
    pub size: usize,
    #[serde(default = "one")]
    pub stride: usize,
    /// Zero padding on each side.
    #[serde(default)]
    pub pad: usize,
    /// Channel groups (2 in AlexNet's two-GPU layers).
    #[serde(default = "one")]
    pub groups: usize,
    /// Weights start as N(0, init_std²).
    pub init_std: f32,
    /// Biases start at this constant.
    pub init_bias: f32,
}

/// `"type": "lrn"`: cross-map response normalisation,
/// `y = x / (k + alpha·Σ x²)^beta` over `size` neighbouring maps. `alpha`
/// multiplies the plain sum (the paper's α = 1e-4, PyTorch's 5e-4 / 5).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct LrnLayer {
    pub size: usize,
    pub alpha: f32,
    pub beta: f32,
    pub k: f32,
}

/// `"type": "maxpool"`: max over `size × size` windows, no padding.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct PoolLayer {
    pub size: usize,
    pub stride: usize,
}

/// `"type": "fc"`: fully connected over the flattened (C, H, W) input.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct FcLayer {
    pub outputs: usize,
    pub init_std: f32,
    pub init_bias: f32,
}

/// `"type": "dropout"`: inverted dropout, each element dropped with
/// probability `p`.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct DropoutLayer {
    pub p: f32,
}

fn one() -> usize {
    1
}

impl LayerKind {
    /// The JSON `type` string.
    pub fn type_name(&self) -> &'static str {
        match self {
            LayerKind::Conv(_) => "conv",
            LayerKind::Relu => "relu",
            LayerKind::Lrn(_) => "lrn",
            LayerKind::MaxPool(_) => "maxpool",
            LayerKind::Fc(_) => "fc",
            LayerKind::Dropout(_) => "dropout",
            LayerKind::Softmax => "softmax",
        }
    }
}

fn json_type(v: &Value) -> &'static str {
    match v {
        Value::Null => "null",
        Value::Bool(_) => "a boolean",
        Value::Number(_) => "a number",
        Value::String(_) => "a string",
        Value::Array(_) => "an array",
        Value::Object(_) => "an object",
    }
}

/// A JSON object's fields, rejecting a key that appears twice (a plain
/// `Map` would silently keep the last one).
struct UniqueFields(serde_json::Map<String, Value>);

impl<'de> Deserialize<'de> for UniqueFields {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct FieldsVisitor;
        impl<'de> Visitor<'de> for FieldsVisitor {
            type Value = UniqueFields;
            fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
                f.write_str("a layer object")
            }
            fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<UniqueFields, A::Error> {
                let mut fields = serde_json::Map::new();
                while let Some((key, value)) = map.next_entry::<String, Value>()? {
                    if fields.contains_key(&key) {
                        return Err(A::Error::custom(format!("duplicate field `{key}`")));
                    }
                    fields.insert(key, value);
                }
                Ok(UniqueFields(fields))
            }
        }
        d.deserialize_map(FieldsVisitor)
    }
}

impl<'de> Deserialize<'de> for LayerConfig {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let UniqueFields(mut fields) = UniqueFields::deserialize(d)?;
        let name = match fields.remove("name") {
            Some(Value::String(name)) => name,
            Some(other) => {
                return Err(D::Error::custom(format!(
                    "`name` must be a string, got {}",
                    json_type(&other)
                )));
            }
            None => return Err(D::Error::missing_field("name")),
        };
        let extra = fields.keys().find(|k| *k != "type").cloned();
        let kind = LayerKind::deserialize(Value::Object(fields))
            .map_err(|e| D::Error::custom(format!("layer {name:?}: {e}")))?;
        // serde lets internally tagged unit variants ignore other fields.
        if let (LayerKind::Relu | LayerKind::Softmax, Some(extra)) = (&kind, extra) {
            return Err(D::Error::custom(format!(
                "layer {name:?}: unknown field `{extra}`, a {} layer has no parameters",
                kind.type_name()
            )));
        }
        Ok(LayerConfig { name, kind })
    }
}

impl Serialize for LayerConfig {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        let Value::Object(mut fields) =
            serde_json::to_value(&self.kind).map_err(S::Error::custom)?
        else {
            return Err(S::Error::custom(
                "layer parameters must serialise to an object",
            ));
        };
        let mut map = s.serialize_map(Some(fields.len() + 1))?;
        map.serialize_entry("name", &self.name)?;
        if let Some(ty) = fields.remove("type") {
            map.serialize_entry("type", &ty)?;
        }
        for (key, value) in &fields {
            map.serialize_entry(key, value)?;
        }
        map.end()
    }
}

/// A validated network: input shape, class count and layers with shapes.
#[derive(Clone, Debug, PartialEq)]
pub struct ModelSpec {
    /// (C, H, W) of one input sample.
    pub input: [usize; 3],
    pub classes: usize,
    pub layers: Vec<LayerSpec>,
}

/// One validated layer with its inferred per-sample shapes, (C, H, W); fc
/// outputs are `[outputs, 1, 1]`.
#[derive(Clone, Debug, PartialEq)]
pub struct LayerSpec {
    pub name: String,
    pub kind: LayerKind,
    pub in_shape: [usize; 3],
    pub out_shape: [usize; 3],
}

/// `96×55×55`.
fn shape_str(s: [usize; 3]) -> String {
    format!("{}×{}×{}", s[0], s[1], s[2])
}

impl LayerSpec {
    /// Elements of one input sample.
    pub fn in_len(&self) -> usize {
        self.in_shape.iter().product()
    }

    /// Elements of one output sample.
    pub fn out_len(&self) -> usize {
        self.out_shape.iter().product()
    }

    /// Parameter tensors as (`<name>.weight` / `<name>.bias`, PyTorch shape);
    /// empty for layers without parameters.
    pub fn param_shapes(&self) -> Vec<(String, Vec<usize>)> {
        let (weight, bias) = match &self.kind {
            LayerKind::Conv(c) => (
                vec![c.filters, self.in_shape[0] / c.groups, c.size, c.size],
                c.filters,
            ),
            LayerKind::Fc(f) => (vec![f.outputs, self.in_len()], f.outputs),
            _ => return Vec::new(),
        };
        vec![
            (format!("{}.weight", self.name), weight),
            (format!("{}.bias", self.name), vec![bias]),
        ]
    }

    /// Number of trainable parameters.
    pub fn param_count(&self) -> usize {
        self.param_shapes()
            .iter()
            .map(|(_, shape)| shape.iter().product::<usize>())
            .sum()
    }

    /// Multiply-adds of the forward pass for one sample (conv and fc only).
    pub fn macs(&self) -> usize {
        match &self.kind {
            LayerKind::Conv(c) => self.out_len() * (self.in_shape[0] / c.groups) * c.size * c.size,
            LayerKind::Fc(f) => self.in_len() * f.outputs,
            _ => 0,
        }
    }

    /// The backend geometry of a conv layer for a batch of `n`.
    pub fn conv_geom(&self, n: usize) -> Option<ConvGeom> {
        let LayerKind::Conv(c) = &self.kind else {
            return None;
        };
        let [c_in, h, w] = self.in_shape;
        Some(ConvGeom {
            n,
            c_in,
            h,
            w,
            c_out: c.filters,
            k_h: c.size,
            k_w: c.size,
            stride: c.stride,
            pad: c.pad,
            groups: c.groups,
        })
    }

    /// The backend geometry of an fc layer for a batch of `n`.
    pub fn fc_geom(&self, n: usize) -> Option<FcGeom> {
        let LayerKind::Fc(f) = &self.kind else {
            return None;
        };
        Some(FcGeom {
            n,
            inputs: self.in_len(),
            outputs: f.outputs,
        })
    }

    /// The backend geometry of a max-pool layer for a batch of `n`.
    pub fn pool_geom(&self, n: usize) -> Option<PoolGeom> {
        let LayerKind::MaxPool(p) = &self.kind else {
            return None;
        };
        let [c, h, w] = self.in_shape;
        Some(PoolGeom {
            n,
            c,
            h,
            w,
            size: p.size,
            stride: p.stride,
        })
    }

    /// The backend parameters of an LRN layer for a batch of `n`.
    pub fn lrn_params(&self, n: usize) -> Option<LrnParams> {
        let LayerKind::Lrn(l) = &self.kind else {
            return None;
        };
        let [c, h, w] = self.in_shape;
        Some(LrnParams {
            n,
            c,
            h,
            w,
            size: l.size,
            alpha: l.alpha,
            beta: l.beta,
            k: l.k,
        })
    }
}

impl ModelSpec {
    /// Checks `cfg` and infers every layer's shapes. The first problem found
    /// is returned with its JSON path.
    pub(crate) fn from_config(cfg: &ModelConfig) -> Result<Self, Invalid> {
        let InputShape {
            channels,
            height,
            width,
        } = cfg.input;
        at_least_one("model.input.channels", channels)?;
        at_least_one("model.input.height", height)?;
        at_least_one("model.input.width", width)?;
        checked_product("model.input", &[channels, height, width])?;
        if cfg.classes < 2 {
            return invalid("model.classes", format!("must be ≥ 2, got {}", cfg.classes));
        }
        let Some(last) = cfg.layers.len().checked_sub(1) else {
            return invalid(
                "model.layers",
                "must not be empty (a network ends with a softmax layer)",
            );
        };

        let mut layers: Vec<LayerSpec> = Vec::with_capacity(cfg.layers.len());
        let mut shape = [channels, height, width];
        let mut params = 0usize;
        for (i, layer) in cfg.layers.iter().enumerate() {
            let path = format!("model.layers[{i}]");
            check_name(&path, &layer.name)?;
            if let Some(j) = layers.iter().position(|l| l.name == layer.name) {
                return invalid(
                    format!("{path}.name"),
                    format!(
                        "duplicate layer name {:?} (also model.layers[{j}])",
                        layer.name
                    ),
                );
            }
            if matches!(layer.kind, LayerKind::Softmax) && i != last {
                return invalid(
                    format!("{path}.type"),
                    format!(
                        "softmax must be the last layer (it is fused with the loss), but {} more follow",
                        last - i
                    ),
                );
            }
            let spec = LayerSpec {
                name: layer.name.clone(),
                kind: layer.kind.clone(),
                in_shape: shape,
                out_shape: infer(&path, &layer.kind, shape)?,
            };
            for (tensor, dims) in spec.param_shapes() {
                let len = checked_product(&path, &dims)
                    .map_err(|_| too_large(&path, format!("parameter {tensor}")))?;
                params = params
                    .checked_add(len)
                    .ok_or_else(|| too_large("model.layers", "the parameter count".into()))?;
            }
            shape = spec.out_shape;
            layers.push(spec);
        }

        let end = &layers[last];
        let path = format!("model.layers[{last}]");
        if !matches!(end.kind, LayerKind::Softmax) {
            return invalid(
                format!("{path}.type"),
                format!(
                    "the last layer must be softmax (fused with the loss), got {:?}",
                    end.kind.type_name()
                ),
            );
        }
        let [c, h, w] = end.in_shape;
        if (h, w) != (1, 1) {
            return invalid(
                path,
                format!(
                    "softmax needs a flat input from an fc layer, got {}",
                    shape_str(end.in_shape)
                ),
            );
        }
        if c != cfg.classes {
            let before = last.checked_sub(1).map_or("the input".to_string(), |j| {
                format!("layer {:?}", layers[j].name)
            });
            return invalid(
                "model.classes",
                format!(
                    "{} does not match the {c} outputs of {before} feeding softmax",
                    cfg.classes
                ),
            );
        }
        Ok(ModelSpec {
            input: [channels, height, width],
            classes: cfg.classes,
            layers,
        })
    }

    /// The `model` section that describes this network.
    pub fn to_config(&self) -> ModelConfig {
        let [channels, height, width] = self.input;
        ModelConfig {
            input: InputShape {
                channels,
                height,
                width,
            },
            classes: self.classes,
            layers: self
                .layers
                .iter()
                .map(|l| LayerConfig {
                    name: l.name.clone(),
                    kind: l.kind.clone(),
                })
                .collect(),
        }
    }

    /// Elements of one input sample.
    pub fn input_len(&self) -> usize {
        self.input.iter().product()
    }

    /// The layer called `name`.
    pub fn layer(&self, name: &str) -> Option<&LayerSpec> {
        self.layers.iter().find(|l| l.name == name)
    }

    /// All parameter tensors in layer order, as (`<name>.weight` /
    /// `<name>.bias`, PyTorch shape).
    pub fn param_shapes(&self) -> Vec<(String, Vec<usize>)> {
        self.layers
            .iter()
            .flat_map(LayerSpec::param_shapes)
            .collect()
    }

    /// Number of trainable parameters.
    pub fn param_count(&self) -> usize {
        self.layers.iter().map(LayerSpec::param_count).sum()
    }

    /// Multiply-adds of one sample's forward pass.
    pub fn macs(&self) -> usize {
        self.layers.iter().map(LayerSpec::macs).sum()
    }
}

fn at_least_one(path: &str, value: usize) -> Result<(), Invalid> {
    if value == 0 {
        return invalid(path, "must be ≥ 1, got 0");
    }
    Ok(())
}

fn too_large(path: &str, what: String) -> Invalid {
    Invalid {
        path: path.to_string(),
        message: format!("{what} is too large to count"),
    }
}

fn checked_product(path: &str, dims: &[usize]) -> Result<usize, Invalid> {
    dims.iter()
        .try_fold(1usize, |acc, &d| acc.checked_mul(d))
        .ok_or_else(|| too_large(path, "the tensor size".into()))
}

/// Names prefix parameter names (`conv1.weight`), so no dots or spaces.
fn check_name(path: &str, name: &str) -> Result<(), Invalid> {
    let ok = !name.is_empty()
        && name
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || c == '_' || c == '-');
    if !ok {
        return invalid(
            format!("{path}.name"),
            format!("{name:?} is not a valid layer name (use letters, digits, '_' and '-')"),
        );
    }
    Ok(())
}

fn check_init(path: &str, init_std: f32, init_bias: f32) -> Result<(), Invalid> {
    require(
        &format!("{path}.init_std"),
        init_std,
        init_std >= 0.0,
        "≥ 0",
    )?;
    require(&format!("{path}.init_bias"), init_bias, true, "finite")
}

/// The output shape of `kind` for an input of shape `[c, h, w]`, after
/// checking its parameters against that input.
fn infer(path: &str, kind: &LayerKind, [c, h, w]: [usize; 3]) -> Result<[usize; 3], Invalid> {
    let field = |name: &str| format!("{path}.{name}");
    let out = match kind {
        LayerKind::Conv(conv) => {
            at_least_one(&field("filters"), conv.filters)?;
            at_least_one(&field("size"), conv.size)?;
            at_least_one(&field("stride"), conv.stride)?;
            at_least_one(&field("groups"), conv.groups)?;
            if c % conv.groups != 0 {
                return invalid(
                    field("groups"),
                    format!(
                        "input channels {c} are not divisible by groups {}",
                        conv.groups
                    ),
                );
            }
            if conv.filters % conv.groups != 0 {
                return invalid(
                    field("groups"),
                    format!(
                        "filters {} are not divisible by groups {}",
                        conv.filters, conv.groups
                    ),
                );
            }
            check_init(path, conv.init_std, conv.init_bias)?;
            let padded = |x: usize| conv.pad.checked_mul(2).and_then(|p| p.checked_add(x));
            let (Some(ph), Some(pw)) = (padded(h), padded(w)) else {
                return Err(too_large(&field("pad"), "the padded input".into()));
            };
            let k = conv.size;
            if k > ph || k > pw {
                return invalid(
                    field("size"),
                    format!(
                        "{k}×{k} window does not fit the {h}×{w} input padded by {} ({ph}×{pw})",
                        conv.pad
                    ),
                );
            }
            [
                conv.filters,
                (ph - k) / conv.stride + 1,
                (pw - k) / conv.stride + 1,
            ]
        }
        LayerKind::MaxPool(pool) => {
            at_least_one(&field("size"), pool.size)?;
            at_least_one(&field("stride"), pool.stride)?;
            let k = pool.size;
            if k > h || k > w {
                return invalid(
                    field("size"),
                    format!("{k}×{k} window is larger than the {h}×{w} input"),
                );
            }
            [c, (h - k) / pool.stride + 1, (w - k) / pool.stride + 1]
        }
        LayerKind::Lrn(lrn) => {
            at_least_one(&field("size"), lrn.size)?;
            if lrn.size % 2 == 0 {
                return invalid(
                    field("size"),
                    format!(
                        "must be odd (the window is centred on each map), got {}",
                        lrn.size
                    ),
                );
            }
            require(&field("alpha"), lrn.alpha, lrn.alpha >= 0.0, "≥ 0")?;
            require(&field("beta"), lrn.beta, lrn.beta >= 0.0, "≥ 0")?;
            require(&field("k"), lrn.k, lrn.k > 0.0, "> 0")?;
            [c, h, w]
        }
        LayerKind::Fc(fc) => {
            at_least_one(&field("outputs"), fc.outputs)?;
            check_init(path, fc.init_std, fc.init_bias)?;
            [fc.outputs, 1, 1]
        }
        LayerKind::Dropout(d) => {
            require(&field("p"), d.p, (0.0..1.0).contains(&d.p), "in [0, 1)")?;
            [c, h, w]
        }
        LayerKind::Relu | LayerKind::Softmax => [c, h, w],
    };
    checked_product(path, &out)?;
    Ok(out)
}
