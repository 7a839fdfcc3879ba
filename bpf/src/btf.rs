//! A minimal reader of kernel BTF (`/sys/kernel/btf/vmlinux`): just enough to find the
//! byte offset of a struct member by name, so that kernel-side reads (such as a task's
//! `fsbase`, the base of its TLS block) need no per-kernel constants.
//!
//! Format: the kernel's "BPF Type Format" documentation (`Documentation/bpf/btf.rst`,
//! `include/uapi/linux/btf.h`). Only little-endian blobs are read (x86-64 kernels).

use std::sync::OnceLock;

/// Where the running kernel exposes its own BTF.
const VMLINUX_BTF: &str = "/sys/kernel/btf/vmlinux";

const BTF_MAGIC: u16 = 0xeb9f;
/// Size of `struct btf_header` up to `str_len`; `hdr_len` may be larger (newer fields).
const MIN_HEADER_LEN: usize = 24;
/// Size of `struct btf_type`, the common head of every type.
const TYPE_HEAD_LEN: usize = 12;
/// Bound on typedef chains and anonymous-member nesting, against malformed (cyclic) blobs.
const MAX_DEPTH: usize = 32;

// Kind numbers (`BTF_KIND_*`): all are needed, to know how much data follows each type.
const KIND_INT: u32 = 1;
const KIND_PTR: u32 = 2;
const KIND_ARRAY: u32 = 3;
const KIND_STRUCT: u32 = 4;
const KIND_UNION: u32 = 5;
const KIND_ENUM: u32 = 6;
const KIND_FWD: u32 = 7;
const KIND_TYPEDEF: u32 = 8;
const KIND_VOLATILE: u32 = 9;
const KIND_CONST: u32 = 10;
const KIND_RESTRICT: u32 = 11;
const KIND_FUNC: u32 = 12;
const KIND_FUNC_PROTO: u32 = 13;
const KIND_VAR: u32 = 14;
const KIND_DATASEC: u32 = 15;
const KIND_FLOAT: u32 = 16;
const KIND_DECL_TAG: u32 = 17;
const KIND_TYPE_TAG: u32 = 18;
const KIND_ENUM64: u32 = 19;

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum BtfError {
    #[error("cannot read {path}: {reason}")]
    Read { path: String, reason: String },
    #[error("malformed BTF: {0}")]
    Malformed(String),
    #[error("unknown BTF kind {kind} (type id {id}); cannot skip its data")]
    UnknownKind { kind: u32, id: u32 },
    #[error("empty member path")]
    EmptyPath,
    #[error("no struct or union named `{0}`")]
    NoSuchType(String),
    #[error("`{ty}` has no member `{member}`")]
    NoSuchMember { ty: String, member: String },
    #[error("member `{0}` is not a struct or union, cannot look inside it")]
    NotAggregate(String),
}

fn malformed(what: &str) -> BtfError {
    BtfError::Malformed(what.to_string())
}

/// Byte offset of the member named by `path` (`[struct, member, member…]`), following
/// nested members. Typedefs and qualifiers on a member's type are looked through, and a
/// name not found directly is searched inside anonymous struct/union members. A
/// bitfield's offset is that of the byte holding its first bit.
pub fn member_offset(btf: &[u8], path: &[&str]) -> Result<u32, BtfError> {
    let (root, members) = path.split_first().ok_or(BtfError::EmptyPath)?;
    let btf = Btf::parse(btf)?;
    let mut ty = btf.find_aggregate(root)?;
    let mut ty_name = (*root).to_string();
    let mut bits = 0u64;
    for (i, name) in members.iter().enumerate() {
        let (member_bits, member_ty) =
            btf.find_member(ty, name, 0)?
                .ok_or_else(|| BtfError::NoSuchMember {
                    ty: ty_name.clone(),
                    member: (*name).to_string(),
                })?;
        bits += member_bits;
        if i + 1 < members.len() {
            ty = btf
                .aggregate_of(member_ty)
                .ok_or_else(|| BtfError::NotAggregate((*name).to_string()))?;
            ty_name = (*name).to_string();
        }
    }
    u32::try_from(bits / 8).map_err(|_| malformed("member offset overflows u32"))
}

/// Byte offset of `task_struct.thread.fsbase` on the running kernel (x86-64), read once.
pub fn task_fsbase_offset() -> Result<u32, BtfError> {
    static OFFSET: OnceLock<Result<[u32; 1], BtfError>> = OnceLock::new();
    running_kernel(&OFFSET, [&["task_struct", "thread", "fsbase"]]).map(|[o]| o)
}

/// `task_struct.files`, `files_struct.fdt`, `fdtable.max_fds`, `fdtable.fd`, `file.f_inode`
/// and `inode.i_mode` on the running kernel: what an fd is (off-CPU events), read once.
pub fn fd_offsets() -> Result<[u32; 6], BtfError> {
    static OFFSETS: OnceLock<Result<[u32; 6], BtfError>> = OnceLock::new();
    running_kernel(
        &OFFSETS,
        [
            &["task_struct", "files"],
            &["files_struct", "fdt"],
            &["fdtable", "max_fds"],
            &["fdtable", "fd"],
            &["file", "f_inode"],
            &["inode", "i_mode"],
        ],
    )
}

/// Byte offsets of `file.f_path.dentry` and `dentry.d_name.name` on the running kernel:
/// the name of the file an fd maps, read once.
pub fn file_name_offsets() -> Result<[u32; 2], BtfError> {
    static OFFSETS: OnceLock<Result<[u32; 2], BtfError>> = OnceLock::new();
    running_kernel(
        &OFFSETS,
        [&["file", "f_path", "dentry"], &["dentry", "d_name", "name"]],
    )
}

/// The byte offsets of member `paths` in the running kernel's BTF, read once into `cell`.
fn running_kernel<const N: usize>(
    cell: &'static OnceLock<Result<[u32; N], BtfError>>,
    paths: [&[&str]; N],
) -> Result<[u32; N], BtfError> {
    cell.get_or_init(|| {
        let blob = std::fs::read(VMLINUX_BTF).map_err(|e| BtfError::Read {
            path: VMLINUX_BTF.to_string(),
            reason: e.to_string(),
        })?;
        let mut out = [0u32; N];
        for (o, path) in out.iter_mut().zip(paths) {
            *o = member_offset(&blob, path)?;
        }
        Ok(out)
    })
    .clone()
}

/// One parsed type head.
struct Type {
    name_off: u32,
    kind: u32,
    kind_flag: bool,
    vlen: usize,
    /// `size` or `type`, depending on the kind.
    size_or_type: u32,
    /// Where this type's trailing data (members, params…) starts in the type section.
    data: usize,
}

struct Btf<'a> {
    types: &'a [u8],
    strings: &'a [u8],
    /// Start of each type's head in `types`, indexed by type id - 1 (id 0 is `void`).
    starts: Vec<usize>,
}

fn u32_at(bytes: &[u8], at: usize) -> Option<u32> {
    let b = bytes.get(at..at.checked_add(4)?)?;
    Some(u32::from_le_bytes([b[0], b[1], b[2], b[3]]))
}

/// Bytes of data after the type head, per kind (from `btf.rst`).
fn trailing_len(kind: u32, vlen: usize) -> Option<usize> {
    Some(match kind {
        KIND_INT => 4,
        KIND_ARRAY => 12,
        KIND_STRUCT | KIND_UNION => 12 * vlen,
        KIND_ENUM => 8 * vlen,
        KIND_ENUM64 => 12 * vlen,
        KIND_FUNC_PROTO => 8 * vlen, // struct btf_param { name_off, type }
        KIND_VAR => 4,
        KIND_DATASEC => 12 * vlen,
        KIND_DECL_TAG => 4,
        KIND_PTR | KIND_FWD | KIND_TYPEDEF | KIND_VOLATILE | KIND_CONST | KIND_RESTRICT
        | KIND_FUNC | KIND_FLOAT | KIND_TYPE_TAG => 0,
        _ => return None,
    })
}

impl<'a> Btf<'a> {
    fn parse(blob: &'a [u8]) -> Result<Self, BtfError> {
        let magic = blob.get(..2).map(|b| u16::from_le_bytes([b[0], b[1]]));
        if magic != Some(BTF_MAGIC) {
            return Err(malformed("bad magic (not little-endian BTF)"));
        }
        let field = |i: usize| u32_at(blob, 4 + 4 * i).ok_or_else(|| malformed("truncated header"));
        let hdr_len = field(0)? as usize;
        let (type_off, type_len) = (field(1)? as usize, field(2)? as usize);
        let (str_off, str_len) = (field(3)? as usize, field(4)? as usize);
        if hdr_len < MIN_HEADER_LEN {
            return Err(malformed("header too short"));
        }
        // Section offsets count from the end of the header.
        let section = |off: usize, len: usize| {
            let start = hdr_len.checked_add(off)?;
            blob.get(start..start.checked_add(len)?)
        };
        let types =
            section(type_off, type_len).ok_or_else(|| malformed("type section out of bounds"))?;
        let strings =
            section(str_off, str_len).ok_or_else(|| malformed("string section out of bounds"))?;

        let mut starts = Vec::new();
        let mut at = 0;
        while at < types.len() {
            let info = u32_at(types, at + 4).ok_or_else(|| malformed("truncated type"))?;
            let (kind, vlen) = ((info >> 24) & 0x1f, (info & 0xffff) as usize);
            let id = starts.len() as u32 + 1;
            let extra = trailing_len(kind, vlen).ok_or(BtfError::UnknownKind { kind, id })?;
            starts.push(at);
            at += TYPE_HEAD_LEN + extra;
        }
        if at != types.len() {
            return Err(malformed("last type overruns the type section"));
        }
        Ok(Btf {
            types,
            strings,
            starts,
        })
    }

    fn get(&self, id: u32) -> Option<Type> {
        let at = *self.starts.get((id as usize).checked_sub(1)?)?;
        let info = u32_at(self.types, at + 4)?;
        Some(Type {
            name_off: u32_at(self.types, at)?,
            kind: (info >> 24) & 0x1f,
            kind_flag: info >> 31 == 1,
            vlen: (info & 0xffff) as usize,
            size_or_type: u32_at(self.types, at + 8)?,
            data: at + TYPE_HEAD_LEN,
        })
    }

    /// NUL-terminated string at `off` in the string section ("" when out of bounds).
    fn name(&self, off: u32) -> &'a [u8] {
        let rest = self.strings.get(off as usize..).unwrap_or_default();
        &rest[..rest.iter().position(|&b| b == 0).unwrap_or(rest.len())]
    }

    /// The first struct or union with this name that has a body (not a forward declaration).
    fn find_aggregate(&self, name: &str) -> Result<u32, BtfError> {
        (1..=self.starts.len() as u32)
            .find(|&id| {
                self.get(id).is_some_and(|t| {
                    matches!(t.kind, KIND_STRUCT | KIND_UNION)
                        && self.name(t.name_off) == name.as_bytes()
                })
            })
            .ok_or_else(|| BtfError::NoSuchType(name.to_string()))
    }

    /// The struct/union a member of type `id` is, looking through typedefs and qualifiers.
    fn aggregate_of(&self, mut id: u32) -> Option<u32> {
        for _ in 0..MAX_DEPTH {
            let t = self.get(id)?;
            match t.kind {
                KIND_STRUCT | KIND_UNION => return Some(id),
                KIND_TYPEDEF | KIND_CONST | KIND_VOLATILE | KIND_RESTRICT | KIND_TYPE_TAG => {
                    id = t.size_or_type
                }
                _ => return None,
            }
        }
        None
    }

    /// Bit offset and type of member `name` in aggregate `id`, searching anonymous
    /// struct/union members (which C lets one name through) when not found directly.
    fn find_member(
        &self,
        id: u32,
        name: &str,
        depth: usize,
    ) -> Result<Option<(u64, u32)>, BtfError> {
        if depth > MAX_DEPTH {
            return Err(malformed("anonymous members nest too deep"));
        }
        let t = self
            .get(id)
            .ok_or_else(|| malformed("type id out of range"))?;
        let members = (0..t.vlen).map(|i| {
            let at = t.data + 12 * i;
            let field = |k: usize| u32_at(self.types, at + 4 * k).unwrap_or_default();
            let raw_offset = field(2);
            // With kind_flag set, bits 24-31 hold a bitfield size and bits 0-23 the offset.
            let bits = if t.kind_flag {
                raw_offset & 0x00ff_ffff
            } else {
                raw_offset
            };
            (field(0), field(1), u64::from(bits))
        });
        let mut anonymous = Vec::new();
        for (name_off, ty, bits) in members {
            let member_name = self.name(name_off);
            if member_name == name.as_bytes() {
                return Ok(Some((bits, ty)));
            }
            if member_name.is_empty() {
                anonymous.push((bits, ty));
            }
        }
        for (bits, ty) in anonymous {
            let Some(inner) = self.aggregate_of(ty) else {
                continue;
            };
            if let Some((inner_bits, inner_ty)) = self.find_member(inner, name, depth + 1)? {
                return Ok(Some((bits + inner_bits, inner_ty)));
            }
        }
        Ok(None)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashMap;
    use std::process::Command;

    /// Builds a little-endian BTF blob type by type (ids from 1, in call order).
    struct Builder {
        types: Vec<u8>,
        strings: Vec<u8>,
    }

    impl Builder {
        fn new() -> Self {
            Builder {
                types: Vec::new(),
                strings: vec![0],
            }
        }
        fn string(&mut self, s: &str) -> u32 {
            if s.is_empty() {
                return 0;
            }
            let off = self.strings.len() as u32;
            self.strings.extend_from_slice(s.as_bytes());
            self.strings.push(0);
            off
        }
        fn words(&mut self, words: &[u32]) {
            for w in words {
                self.types.extend_from_slice(&w.to_le_bytes());
            }
        }
        fn head(&mut self, name: &str, kind: u32, kind_flag: bool, vlen: u32, size_or_type: u32) {
            let name_off = self.string(name);
            let info = (u32::from(kind_flag) << 31) | (kind << 24) | vlen;
            self.words(&[name_off, info, size_or_type]);
        }
        /// Members are (name, type id, raw offset word).
        fn aggregate(
            &mut self,
            kind: u32,
            name: &str,
            kind_flag: bool,
            size: u32,
            members: &[(&str, u32, u32)],
        ) {
            self.head(name, kind, kind_flag, members.len() as u32, size);
            for &(m, ty, off) in members {
                let m = self.string(m);
                self.words(&[m, ty, off]);
            }
        }
        fn finish(self) -> Vec<u8> {
            let mut blob = Vec::new();
            blob.extend_from_slice(&BTF_MAGIC.to_le_bytes());
            blob.extend_from_slice(&[1, 0]); // version, flags
            let type_len = self.types.len() as u32;
            for w in [24, 0, type_len, type_len, self.strings.len() as u32] {
                blob.extend_from_slice(&w.to_le_bytes());
            }
            blob.extend_from_slice(&self.types);
            blob.extend_from_slice(&self.strings);
            blob
        }
    }

    /// A blob with every kind of trailing data before the structs, so a wrong skip length
    /// shifts every later type.
    fn tiny_blob() -> Vec<u8> {
        let mut b = Builder::new();
        b.head("int", KIND_INT, false, 0, 4); // 1
        b.words(&[32]);
        b.head("", KIND_ARRAY, false, 0, 0); // 2: int[4]
        b.words(&[1, 1, 4]);
        b.head("color", KIND_ENUM, false, 2, 4); // 3
        let (red, blue) = (b.string("RED"), b.string("BLUE"));
        b.words(&[red, 0, blue, 1]);
        b.head("big", KIND_ENUM64, false, 1, 8); // 4
        let huge = b.string("HUGE");
        b.words(&[huge, 0, 1]);
        b.head("", KIND_FUNC_PROTO, false, 2, 1); // 5: int (int a, int b)
        let (a, bb) = (b.string("a"), b.string("b"));
        b.words(&[a, 1, bb, 1]);
        b.head("f", KIND_FUNC, false, 0, 5); // 6
        b.head("v", KIND_VAR, false, 0, 1); // 7
        b.words(&[1]);
        b.head(".data", KIND_DATASEC, false, 1, 4); // 8
        b.words(&[7, 0, 4]);
        b.head("tag", KIND_DECL_TAG, false, 0, 6); // 9
        b.words(&[u32::MAX]);
        b.head("", KIND_PTR, false, 0, 1); // 10
        b.head("inner", KIND_FWD, false, 0, 0); // 11: a forward declaration is skipped
        b.aggregate(KIND_STRUCT, "inner", false, 8, &[("a", 1, 0), ("b", 1, 32)]); // 12
        b.head("inner_t", KIND_TYPEDEF, false, 0, 12); // 13
        b.head("", KIND_CONST, false, 0, 13); // 14: const inner_t
        b.aggregate(KIND_UNION, "", false, 8, &[("x", 1, 0), ("y", 14, 0)]); // 15
        b.aggregate(
            KIND_STRUCT,
            "outer",
            true, // bitfield encoding: size << 24 | bit offset
            32,
            &[
                ("flags", 1, 3 << 24),
                ("mode", 1, (5 << 24) | 3),
                ("", 15, 64),
                ("tail", 2, 192),
            ],
        ); // 16
        b.finish()
    }

    #[test]
    fn tiny_blob_offsets() {
        let blob = tiny_blob();
        let off = |path: &[&str]| member_offset(&blob, path);
        assert_eq!(off(&["inner", "b"]), Ok(4));
        assert_eq!(off(&["outer", "flags"]), Ok(0));
        assert_eq!(off(&["outer", "mode"]), Ok(0)); // bits 3..8 lie in byte 0
        assert_eq!(off(&["outer", "x"]), Ok(8)); // through the anonymous union
        assert_eq!(off(&["outer", "y", "b"]), Ok(12)); // and through const + typedef
        assert_eq!(off(&["outer", "tail"]), Ok(24));
        assert_eq!(off(&["outer"]), Ok(0));
    }

    #[test]
    fn tiny_blob_errors() {
        let blob = tiny_blob();
        let off = |path: &[&str]| member_offset(&blob, path);
        assert_eq!(off(&[]), Err(BtfError::EmptyPath));
        assert_eq!(
            off(&["nope", "a"]),
            Err(BtfError::NoSuchType("nope".into()))
        );
        assert_eq!(
            off(&["outer", "nope"]),
            Err(BtfError::NoSuchMember {
                ty: "outer".into(),
                member: "nope".into()
            })
        );
        assert_eq!(
            off(&["outer", "x", "a"]),
            Err(BtfError::NotAggregate("x".into()))
        );
        assert!(matches!(
            member_offset(&blob[..30], &["outer"]),
            Err(BtfError::Malformed(_))
        ));
        let mut bad_magic = blob.clone();
        bad_magic[0] = 0;
        assert!(matches!(
            member_offset(&bad_magic, &["outer"]),
            Err(BtfError::Malformed(_))
        ));
        // An unknown kind cannot be skipped: its data length is unknown.
        let mut unknown = blob;
        unknown[24 + 7] = 31; // high byte of the first type's info word
        assert_eq!(
            member_offset(&unknown, &["outer"]),
            Err(BtfError::UnknownKind { kind: 31, id: 1 })
        );
    }

    /// One type of `bpftool btf dump … format raw`.
    struct RawType {
        kind: String,
        name: String,
        /// The `type_id=` it refers to (typedefs, qualifiers), else 0.
        target: u32,
        /// (name, type id, bit offset).
        members: Vec<(String, u32, u64)>,
    }

    /// Ground truth from bpftool's raw dump, by type id.
    struct RawDump {
        types: HashMap<u32, RawType>,
    }

    fn quoted(s: &str) -> String {
        s.split('\'').nth(1).unwrap_or_default().to_string()
    }

    fn field(s: &str, key: &str) -> u64 {
        s.split_whitespace()
            .find_map(|w| w.strip_prefix(key))
            .and_then(|v| v.parse().ok())
            .unwrap_or(0)
    }

    impl RawDump {
        fn parse(text: &str) -> Self {
            let mut types = HashMap::new();
            let mut current = 0;
            for line in text.lines() {
                if let Some(rest) = line.strip_prefix('[') {
                    let (id, rest) = rest.split_once("] ").unwrap();
                    current = id.parse().unwrap();
                    let raw = RawType {
                        kind: rest.split_whitespace().next().unwrap().to_string(),
                        name: quoted(rest),
                        target: field(rest, "type_id=") as u32,
                        members: Vec::new(),
                    };
                    types.insert(current, raw);
                } else if line.starts_with('\t') && line.contains("bits_offset=") {
                    let member = (
                        quoted(line),
                        field(line, "type_id=") as u32,
                        field(line, "bits_offset="),
                    );
                    types.get_mut(&current).unwrap().members.push(member);
                }
            }
            RawDump { types }
        }

        fn strip(&self, mut id: u32) -> u32 {
            while let Some(t) = self.types.get(&id) {
                if !matches!(
                    t.kind.as_str(),
                    "TYPEDEF" | "CONST" | "VOLATILE" | "RESTRICT" | "TYPE_TAG"
                ) {
                    break;
                }
                id = t.target;
            }
            id
        }

        /// (bit offset, type id) of `name` in `id`, depth-first through `(anon)` members.
        fn member(&self, id: u32, name: &str) -> Option<(u64, u32)> {
            let members = &self.types.get(&self.strip(id))?.members;
            if let Some((_, ty, bits)) = members.iter().find(|m| m.0 == name) {
                return Some((*bits, *ty));
            }
            members
                .iter()
                .filter(|m| m.0 == "(anon)")
                .find_map(|(_, ty, bits)| self.member(*ty, name).map(|(b, t)| (bits + b, t)))
        }

        fn offset(&self, path: &[&str]) -> Option<u32> {
            let root = self
                .types
                .iter()
                .filter(|(_, t)| matches!(t.kind.as_str(), "STRUCT" | "UNION") && t.name == path[0])
                .map(|(id, _)| *id)
                .min()?;
            let (mut ty, mut bits) = (root, 0);
            for name in &path[1..] {
                let (b, t) = self.member(ty, name)?;
                bits += b;
                ty = t;
            }
            Some((bits / 8) as u32)
        }
    }

    fn kernel_btf() -> Option<Vec<u8>> {
        match std::fs::read(VMLINUX_BTF) {
            Ok(blob) => Some(blob),
            Err(e) => {
                tracer_testkit::skip(format_args!("cannot read {VMLINUX_BTF}: {e}"));
                None
            }
        }
    }

    #[test]
    fn running_kernel_fsbase() {
        let Some(_) = kernel_btf() else { return };
        let offset = task_fsbase_offset().expect("task_struct.thread.fsbase");
        println!("task_struct.thread.fsbase at byte {offset}");
        assert!(
            offset > 0 && offset.is_multiple_of(8),
            "fsbase offset {offset}"
        );
    }

    #[test]
    fn running_kernel_matches_bpftool() {
        let Some(blob) = kernel_btf() else { return };
        let out = match Command::new("bpftool")
            .args(["btf", "dump", "file", VMLINUX_BTF, "format", "raw"])
            .output()
        {
            Ok(out) if out.status.success() => out,
            Ok(out) => {
                return tracer_testkit::skip(format_args!(
                    "bpftool failed: {}",
                    String::from_utf8_lossy(&out.stderr)
                ))
            }
            Err(e) => return tracer_testkit::skip(format_args!("bpftool not available: {e}")),
        };
        let dump = RawDump::parse(&String::from_utf8_lossy(&out.stdout));
        let paths: &[&[&str]] = &[
            &["task_struct", "thread", "fsbase"],
            &["task_struct", "pid"],
            &["task_struct", "tgid"],
            &["task_struct", "thread", "gsbase"],
            &["task_struct", "thread_info", "flags"],
            &["task_struct", "usage", "refs"], // refcount_t: a typedef of a struct
            &["task_struct", "mm"],
            &["sk_buff", "len"],
            &["sk_buff", "next"],     // inside anonymous union and struct
            &["sk_buff", "dev"],      // inside an anonymous union
            &["sk_buff", "protocol"], // inside a struct_group's anonymous members
            &["sk_buff", "cloned"],   // a bitfield
            &["mm_struct", "pgd"],
            &["file", "f_path", "dentry"],
            &["dentry", "d_name", "name"], // after an anonymous union in struct qstr
        ];
        let mut checked = 0;
        for path in paths {
            let Some(expected) = dump.offset(path) else {
                println!("not in this kernel's BTF, not checked: {}", path.join("."));
                continue;
            };
            assert_eq!(
                member_offset(&blob, path),
                Ok(expected),
                "{}",
                path.join(".")
            );
            checked += 1;
        }
        assert!(checked >= 5, "too few paths found in bpftool's dump");
        assert_eq!(
            task_fsbase_offset().ok(),
            dump.offset(&["task_struct", "thread", "fsbase"])
        );
    }
}
