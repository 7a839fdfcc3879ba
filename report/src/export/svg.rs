//! A flame graph as one self-contained SVG file: root at the bottom, each frame as wide as
//! its samples, callees merged by label under each caller and sorted by label, as
//! flamegraph.pl draws them. Clicking a frame zooms to it; clicking the root zooms out.

use std::collections::BTreeMap;
use std::fmt::Write;

use crate::profile::{FrameKind, Profile};

const WIDTH: f64 = 1200.0;
const PAD: f64 = 10.0;
const FRAME_H: f64 = 16.0;
const TOP: f64 = 40.0;
const BOTTOM: f64 = 10.0;
const FONT: f64 = 11.0;
/// Width of one monospace character at `FONT`.
const CHAR_W: f64 = FONT * 0.6;
/// Frames thinner than this share of all samples are left out, with their callees.
const MIN_SHARE: f64 = 0.001;

#[derive(Default)]
struct Node {
    kind: FrameKind,
    /// Function name, which picks the colour whatever the line.
    name: String,
    count: u64,
    children: BTreeMap<String, Node>,
}

impl Node {
    /// Depth of the deepest frame drawn below this one.
    fn depth(&self, min: f64) -> usize {
        let visible = self.children.values().filter(|c| c.count as f64 >= min);
        visible.map(|c| 1 + c.depth(min)).max().unwrap_or(0)
    }
}

/// The flame graph titled `title`.
pub fn svg(p: &Profile, title: &str) -> String {
    let mut root = Node {
        name: "all".into(),
        ..Node::default()
    };
    let unit = p.flame_unit();
    for s in &p.stacks {
        let value = p.flame_value(s);
        root.count += value;
        let mut node = &mut root;
        for f in &s.frames {
            node = node.children.entry(f.label()).or_insert_with(|| Node {
                kind: f.kind,
                name: f.name.clone(),
                ..Node::default()
            });
            node.count += value;
        }
    }
    let min = (root.count as f64 * MIN_SHARE).max(f64::MIN_POSITIVE);
    let height = TOP + (root.depth(min) + 1) as f64 * FRAME_H + BOTTOM;
    let mut out = String::new();
    let _ = write!(
        out,
        r##"<?xml version="1.0" encoding="UTF-8"?>
<svg xmlns="http://www.w3.org/2000/svg" width="{WIDTH}" height="{height}" viewBox="0 0 {WIDTH} {height}">
<style>text {{ font-family: monospace; font-size: {FONT}px; fill: #000; pointer-events: none }} g.f {{ cursor: pointer }} g.f:hover rect {{ stroke: #000; stroke-width: 0.5 }}</style>
<rect width="100%" height="100%" fill="#f8f8f8"/>
<text x="{}" y="24" text-anchor="middle" style="font-size: 17px">{}</text>
"##,
        WIDTH / 2.0,
        escape(title)
    );
    if root.count == 0 {
        let _ = writeln!(
            out,
            r#"<text x="{PAD}" y="{}">No samples</text>"#,
            TOP + 12.0
        );
    } else {
        let mut ctx = Ctx {
            unit,
            out: &mut out,
            total: root.count as f64,
            min,
            height,
        };
        ctx.frame("all", &root, 0, 0);
    }
    let _ = write!(
        out,
        "<script><![CDATA[\nconst AREA = {}, PAD = {PAD}, CHAR_W = {CHAR_W};{SCRIPT}]]></script>\n</svg>\n",
        WIDTH - 2.0 * PAD
    );
    out
}

struct Ctx<'a> {
    out: &'a mut String,
    total: f64,
    min: f64,
    height: f64,
    /// What `Node::count` counts.
    unit: &'static str,
}

impl Ctx<'_> {
    /// Draws `node`, `offset` samples from the left, then its callees above it.
    fn frame(&mut self, label: &str, node: &Node, offset: u64, depth: usize) {
        let (fx, fw) = (offset as f64 / self.total, node.count as f64 / self.total);
        let area = WIDTH - 2.0 * PAD;
        let (x, w) = (PAD + fx * area, fw * area);
        let y = self.height - BOTTOM - (depth + 1) as f64 * FRAME_H;
        let (r, g, b) = colour(node.kind, &node.name);
        let _ = writeln!(
            self.out,
            r#"<g class="f" data-x="{fx}" data-w="{fw}"><title>{} ({} {}, {:.2}%)</title><rect x="{x:.2}" y="{y}" width="{w:.2}" height="{}" rx="2" fill="rgb({r},{g},{b})"/><text x="{:.2}" y="{}">{}</text></g>"#,
            escape(label),
            node.count,
            self.unit,
            fw * 100.0,
            FRAME_H - 1.0,
            x + 3.0,
            y + FRAME_H - 4.5,
            escape(&fit(label, w)),
        );
        let mut offset = offset;
        for (label, child) in &node.children {
            if child.count as f64 >= self.min {
                self.frame(label, child, offset, depth + 1);
            }
            offset += child.count;
        }
    }
}

/// The label cut to what fits in `width` pixels, with `..` where it was cut.
fn fit(label: &str, width: f64) -> String {
    let room = ((width - 6.0) / CHAR_W).max(0.0) as usize;
    let len = label.chars().count();
    if len <= room {
        label.to_owned()
    } else if room < 3 {
        String::new()
    } else {
        label.chars().take(room - 2).chain("..".chars()).collect()
    }
}

/// A hue range per kind of frame, the hue within it and the lightness picked by a hash of
/// the name, so a function has the same colour in every graph.
fn colour(kind: FrameKind, name: &str) -> (u8, u8, u8) {
    // FNV-1a: stable across runs and Rust versions, unlike `DefaultHasher`.
    let h = name.bytes().fold(0xcbf2_9ce4_8422_2325_u64, |h, b| {
        (h ^ u64::from(b)).wrapping_mul(0x0100_0000_01b3)
    });
    let (v1, v2) = (
        (h & 0xffff) as f64 / 65535.0,
        ((h >> 16) & 0xffff) as f64 / 65535.0,
    );
    let (hue, sat) = match kind {
        FrameKind::Python => (190.0 + 40.0 * v1, 0.6),
        FrameKind::Native => (0.0 + 30.0 * v1, 0.7),
        FrameKind::Kernel => (32.0 + 20.0 * v1, 0.8),
        FrameKind::OffCpu => (270.0 + 20.0 * v1, 0.35),
        FrameKind::Task => (120.0 + 20.0 * v1, 0.45),
        FrameKind::Process => (0.0, 0.0),
    };
    hsl(hue, sat, 0.62 + 0.12 * v2)
}

fn hsl(h: f64, s: f64, l: f64) -> (u8, u8, u8) {
    let c = (1.0 - (2.0 * l - 1.0).abs()) * s;
    let x = c * (1.0 - ((h / 60.0) % 2.0 - 1.0).abs());
    let (r, g, b) = match (h / 60.0) as u32 {
        0 => (c, x, 0.0),
        1 => (x, c, 0.0),
        2 => (0.0, c, x),
        3 => (0.0, x, c),
        4 => (x, 0.0, c),
        _ => (c, 0.0, x),
    };
    let m = l - c / 2.0;
    let byte = |v: f64| ((v + m) * 255.0).round() as u8;
    (byte(r), byte(g), byte(b))
}

/// Text and attribute values escaped for XML, characters XML 1.0 forbids (controls other
/// than tab and newline, U+FFFE, U+FFFF) replaced by a space.
fn escape(s: &str) -> String {
    let mut out = String::with_capacity(s.len());
    for c in s.chars() {
        match c {
            '&' => out.push_str("&amp;"),
            '<' => out.push_str("&lt;"),
            '>' => out.push_str("&gt;"),
            '"' => out.push_str("&quot;"),
            '\'' => out.push_str("&apos;"),
            '\t' | '\n' => out.push(c),
            c if c < ' ' || c == '\u{fffe}' || c == '\u{ffff}' => out.push(' '),
            c => out.push(c),
        }
    }
    out
}

/// Zoom: a frame fills the width, its callers span it, frames beside it are hidden.
const SCRIPT: &str = r#"
function fit(label, w) {
  const room = Math.floor(Math.max(w - 6, 0) / CHAR_W);
  if (label.length <= room) return label;
  return room < 3 ? "" : label.slice(0, room - 2) + "..";
}
function zoom(target) {
  const zx = +target.dataset.x, zw = +target.dataset.w;
  for (const g of document.querySelectorAll("g.f")) {
    const fx = +g.dataset.x, fw = +g.dataset.w;
    const lo = Math.max(fx, zx), hi = Math.min(fx + fw, zx + zw);
    g.style.display = hi - lo > 1e-12 ? "" : "none";
    if (hi - lo <= 1e-12) continue;
    const x = PAD + (lo - zx) / zw * AREA, w = (hi - lo) / zw * AREA;
    const rect = g.querySelector("rect"), text = g.querySelector("text");
    const title = g.querySelector("title").textContent;
    rect.setAttribute("x", x.toFixed(2));
    rect.setAttribute("width", w.toFixed(2));
    text.setAttribute("x", (x + 3).toFixed(2));
    text.textContent = fit(title.slice(0, title.lastIndexOf(" (")), w);
  }
}
for (const g of document.querySelectorAll("g.f")) g.addEventListener("click", () => zoom(g));
"#;

#[cfg(test)]
mod tests {
    use super::*;
    use crate::export::folded::tests::example;
    use crate::profile::{Frame, Stack};

    /// A small well-formedness check: tags balance, one root element, attribute values
    /// quoted, `<` and `&` only as markup and entity starts.
    fn check_xml(doc: &str) {
        let mut open: Vec<&str> = Vec::new();
        let mut roots = 0;
        let mut rest = doc;
        while let Some(i) = rest.find(['<', '&']) {
            let text = &rest[..i];
            assert!(
                !open.is_empty() || text.trim().is_empty(),
                "text outside root: {text}"
            );
            rest = &rest[i..];
            if rest.starts_with('&') {
                let end = rest.find(';').expect("unterminated entity");
                let name = &rest[1..end];
                let ok =
                    ["amp", "lt", "gt", "quot", "apos"].contains(&name) || name.starts_with('#');
                assert!(ok, "bad entity &{name};");
                rest = &rest[end + 1..];
                continue;
            }
            for (start, end) in [("<?", "?>"), ("<!--", "-->"), ("<![CDATA[", "]]>")] {
                if rest.starts_with(start) {
                    let close = rest.find(end).expect("unterminated section");
                    rest = &rest[close + end.len()..];
                }
            }
            if !rest.starts_with('<') {
                continue;
            }
            let end = rest.find('>').expect("unterminated tag");
            let tag = &rest[1..end];
            rest = &rest[end + 1..];
            if let Some(name) = tag.strip_prefix('/') {
                assert_eq!(open.pop(), Some(name.trim()), "unbalanced </{name}>");
                continue;
            }
            let (tag, empty) = match tag.strip_suffix('/') {
                Some(t) => (t, true),
                None => (tag, false),
            };
            let name = tag.split_whitespace().next().expect("empty tag");
            // Outside quotes, an attribute part has only names, `=` and spaces.
            let unquoted: String = tag.split('"').step_by(2).collect();
            assert!(!unquoted.contains(['<', '&', '\'']), "bad tag <{tag}>");
            assert_eq!(tag.matches('"').count() % 2, 0, "unquoted <{tag}>");
            if open.is_empty() {
                roots += 1;
            }
            if !empty {
                open.push(name);
            }
        }
        assert!(open.is_empty(), "unclosed {open:?}");
        assert_eq!(roots, 1);
    }

    #[test]
    fn well_formed_with_every_label() {
        let doc = svg(&example(), "tracer <profile> & \"more\"");
        check_xml(&doc);
        assert!(doc.contains("tracer &lt;profile&gt; &amp; &quot;more&quot;"));
        for s in &example().stacks {
            for f in &s.frames {
                let title = format!("<title>{} (", escape(&f.label()));
                assert!(doc.contains(&title), "missing {title}");
            }
        }
        assert!(doc.contains("<title>all (12 samples, 100.00%)</title>"));
        // Threads merge: `work` is one frame of 4 samples.
        assert!(doc.contains("<title>work (/srv/app.py:20) (4 samples, 33.33%)</title>"));
        assert!(doc.contains("std::vector&lt;int&gt;::push_back&amp;"));
        assert!(!doc.contains('\u{1}'));
    }

    #[test]
    fn thin_frames_are_left_out() {
        // Under 0.1% of the samples: every stack but `work`'s, which is three frames deep.
        let mut p = example();
        let mut big = p.stacks[1].clone();
        big.count = 100_000;
        p.stacks.push(big);
        let doc = svg(&p, "t");
        check_xml(&doc);
        assert!(doc.contains("work (/srv/app.py:20)"));
        assert!(!doc.contains("do_syscall_64"), "{doc}");
        assert!(!doc.contains("worker (pid 200)"), "{doc}");
        // Left-out frames leave no empty rows: `all` and three frames.
        let height = TOP + 4.0 * FRAME_H + BOTTOM;
        assert!(doc.contains(&format!(" height=\"{height}\" ")), "{doc}");
    }

    #[test]
    fn empty_and_hostile_input() {
        check_xml(&svg(&Profile::default(), "empty"));
        let p = Profile {
            stacks: vec![Stack {
                frames: vec![Frame {
                    name: "a\u{1}b</g>]]>".into(),
                    ..Frame::default()
                }],
                count: 1,
                ..Stack::default()
            }],
            ..Profile::default()
        };
        let doc = svg(&p, "x");
        check_xml(&doc);
        assert!(doc.contains("a b&lt;/g&gt;]]&gt;"));
    }

    #[test]
    fn labels_are_cut_to_fit() {
        assert_eq!(fit("short", 100.0), "short");
        assert_eq!(fit("a_long_function_name", 6.0 + 8.0 * CHAR_W), "a_long..");
        assert_eq!(fit("abc", 10.0), "");
    }
}
