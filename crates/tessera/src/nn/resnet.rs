//! ResNet (He et al. 2015) as torchvision builds it: ResNet-18/34 from
//! basic blocks, ResNet-50/101/152 from bottlenecks (the stride on the 3×3
//! conv, "ResNet v1.5"), with the same parameter names
//! (`layer1.0.conv1.weight`, `layer2.0.downsample.0.weight`, `fc.weight`, …).

use super::conv::{AdaptiveAvgPool2d, BatchNorm2d, Conv2d, MaxPool2d};
use super::{join_name, within, Linear, ParamStore};
use crate::error::Result;
use crate::tensor::{unwrap_or_panic, ConvOptions, Generator, PoolOptions, Tensor};

/// The residual block type.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Block {
    /// Two 3×3 convs (ResNet-18/34).
    Basic,
    /// 1×1, 3×3, 1×1 (×4 channels) (ResNet-50 and deeper).
    Bottleneck,
}

impl Block {
    fn expansion(self) -> usize {
        match self {
            Block::Basic => 1,
            Block::Bottleneck => 4,
        }
    }
}

/// A ResNet's shape.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ResNetConfig {
    pub block: Block,
    /// Blocks per stage.
    pub layers: [usize; 4],
    pub num_classes: usize,
    /// Channels of the stem and the first stage (64 in the paper); the
    /// stages have `width`, 2·, 4·, 8·`width` (times the expansion).
    pub width: usize,
    pub in_channels: usize,
}

impl ResNetConfig {
    pub fn resnet18(num_classes: usize) -> ResNetConfig {
        ResNetConfig {
            block: Block::Basic,
            layers: [2, 2, 2, 2],
            num_classes,
            width: 64,
            in_channels: 3,
        }
    }

    pub fn resnet50(num_classes: usize) -> ResNetConfig {
        ResNetConfig {
            block: Block::Bottleneck,
            layers: [3, 4, 6, 3],
            num_classes,
            width: 64,
            in_channels: 3,
        }
    }
}

fn conv(
    store: &mut ParamStore,
    name: &str,
    (cin, cout, k, stride): (usize, usize, usize, usize),
    g: &mut Generator,
) -> Conv2d {
    let opts = ConvOptions::default().stride(stride).padding(k / 2);
    Conv2d::new(store, name, cin, cout, [k, k], opts, false, g)
}

/// One residual block: convs with batch norms, and the shortcut (a 1×1
/// conv + batch norm when the shape changes).
struct Residual {
    name: String,
    convs: Vec<(Conv2d, BatchNorm2d)>,
    downsample: Option<(Conv2d, BatchNorm2d)>,
}

impl Residual {
    fn new(
        store: &mut ParamStore,
        name: &str,
        block: Block,
        (cin, planes, stride): (usize, usize, usize),
        g: &mut Generator,
    ) -> Residual {
        let out = planes * block.expansion();
        let shapes: Vec<(usize, usize, usize, usize)> = match block {
            Block::Basic => vec![(cin, planes, 3, stride), (planes, planes, 3, 1)],
            Block::Bottleneck => vec![
                (cin, planes, 1, 1),
                (planes, planes, 3, stride),
                (planes, out, 1, 1),
            ],
        };
        let convs = shapes
            .into_iter()
            .enumerate()
            .map(|(i, s)| {
                let c = conv(store, &join_name(name, &format!("conv{}", i + 1)), s, g);
                let bn = BatchNorm2d::new(store, &join_name(name, &format!("bn{}", i + 1)), s.1);
                (c, bn)
            })
            .collect();
        let downsample = (stride != 1 || cin != out).then(|| {
            let c = conv(
                store,
                &join_name(name, "downsample.0"),
                (cin, out, 1, stride),
                g,
            );
            (
                c,
                BatchNorm2d::new(store, &join_name(name, "downsample.1"), out),
            )
        });
        Residual {
            name: name.to_string(),
            convs,
            downsample,
        }
    }

    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        let mut h = x.clone();
        let last = self.convs.len() - 1;
        for (i, (c, bn)) in self.convs.iter().enumerate() {
            h = bn.try_forward(&c.try_forward(&h)?)?;
            if i < last {
                h = h.try_relu()?;
            }
        }
        let shortcut = match &self.downsample {
            Some((c, bn)) => bn.try_forward(&c.try_forward(x)?)?,
            None => x.clone(),
        };
        h.try_add(&shortcut)?
            .try_relu()
            .map_err(|e| within(e, "ResNet block", &self.name))
    }

    fn norms(&self) -> impl Iterator<Item = &BatchNorm2d> {
        self.convs
            .iter()
            .map(|(_, bn)| bn)
            .chain(self.downsample.iter().map(|(_, bn)| bn))
    }
}

/// A ResNet: stem (7×7/2 conv, batch norm, ReLU, 3×3/2 max pool), four
/// stages of residual blocks, global average pool, linear classifier.
pub struct ResNet {
    pub config: ResNetConfig,
    conv1: Conv2d,
    bn1: BatchNorm2d,
    maxpool: MaxPool2d,
    blocks: Vec<Residual>,
    avgpool: AdaptiveAvgPool2d,
    pub fc: Linear,
}

impl ResNet {
    /// Registers every parameter under `name` (`""` for torchvision's
    /// names).
    #[track_caller]
    pub fn new(
        store: &mut ParamStore,
        name: &str,
        config: ResNetConfig,
        generator: &mut Generator,
    ) -> ResNet {
        let g = generator;
        let w = config.width;
        let conv1 = Conv2d::new(
            store,
            &join_name(name, "conv1"),
            config.in_channels,
            w,
            [7, 7],
            ConvOptions::default().stride(2).padding(3),
            false,
            g,
        );
        let bn1 = BatchNorm2d::new(store, &join_name(name, "bn1"), w);
        let mut blocks = Vec::new();
        let mut cin = w;
        for (stage, &n) in config.layers.iter().enumerate() {
            let planes = w << stage;
            for i in 0..n {
                let stride = if stage > 0 && i == 0 { 2 } else { 1 };
                let block_name = join_name(name, &format!("layer{}.{i}", stage + 1));
                blocks.push(Residual::new(
                    store,
                    &block_name,
                    config.block,
                    (cin, planes, stride),
                    g,
                ));
                cin = planes * config.block.expansion();
            }
        }
        let fc = Linear::new(
            store,
            &join_name(name, "fc"),
            cin,
            config.num_classes,
            true,
            g,
        );
        ResNet {
            config,
            conv1,
            bn1,
            maxpool: MaxPool2d::new(PoolOptions::new(3).stride(2).padding(1)),
            blocks,
            avgpool: AdaptiveAvgPool2d::new([1, 1]),
            fc,
        }
    }

    /// Training (true: batch statistics, running update) or eval mode for
    /// every batch norm.
    pub fn train(&self, training: bool) {
        self.bn1.train(training);
        for b in &self.blocks {
            b.norms().for_each(|bn| bn.train(training));
        }
    }

    /// `x [N, in_channels, H, W]` → logits `[N, num_classes]`.
    #[track_caller]
    pub fn forward(&self, x: &Tensor) -> Tensor {
        unwrap_or_panic(self.try_forward(x))
    }

    /// [`ResNet::forward`], returning the error instead of panicking.
    #[track_caller]
    pub fn try_forward(&self, x: &Tensor) -> Result<Tensor> {
        let h = self
            .bn1
            .try_forward(&self.conv1.try_forward(x)?)?
            .try_relu()?;
        let mut h = self.maxpool.try_forward(&h)?;
        for b in &self.blocks {
            h = b.forward(&h)?;
        }
        let h = self.avgpool.try_forward(&h)?.try_flatten(1, -1)?;
        self.fc.try_forward(&h)
    }
}
