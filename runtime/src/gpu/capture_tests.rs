//! [`Gpu::capture`] and [`Gpu::replay`] over a device that logs launches instead of running them:
//! what is recorded, what recording refuses, and when a graph goes stale.

use std::sync::Mutex;

use super::{Device, DeviceInfo, Gpu, LaunchCfg, Vendor};
use crate::{Backend, DType, Error, Recorded, Result};

/// Logs the kernel names it runs; records them between `begin_capture` and `end_capture`.
#[derive(Debug)]
struct Logger {
    info: DeviceInfo,
    ran: Mutex<Vec<&'static str>>,
    recording: Mutex<Option<Vec<&'static str>>>,
}

impl Logger {
    fn new() -> Self {
        let info = DeviceInfo {
            name: "logger".into(),
            vendor: Vendor::Simt,
            arch: (0, 0),
            warp_size: 32,
            sm_count: 1,
            max_shared_per_block: 1024,
            max_threads_per_block: 1024,
            max_grid: [1024; 3],
            total_memory: 1 << 20,
        };
        Logger { info, ran: Mutex::new(Vec::new()), recording: Mutex::new(None) }
    }
}

fn device_err(msg: &str) -> Error {
    Error::Device { device: "logger".into(), msg: msg.into() }
}

impl Device for Logger {
    type Buffer = Vec<u8>;
    type Graph = Vec<&'static str>;

    fn name(&self) -> &'static str {
        "logger"
    }
    fn info(&self) -> &DeviceInfo {
        &self.info
    }
    fn alloc(&self, bytes: usize) -> Result<Vec<u8>> {
        Ok(vec![0; bytes.max(1)])
    }
    fn len(buf: &Vec<u8>) -> usize {
        buf.len()
    }
    fn address(buf: &Vec<u8>) -> u64 {
        buf.as_ptr() as u64
    }
    fn write(&self, dst: &mut Vec<u8>, offset: usize, bytes: &[u8]) -> Result<()> {
        dst[offset..offset + bytes.len()].copy_from_slice(bytes);
        Ok(())
    }
    fn zero(&self, dst: &mut Vec<u8>, offset: usize, len: usize) -> Result<()> {
        dst[offset..offset + len].fill(0);
        Ok(())
    }
    fn read(&self, src: &Vec<u8>, offset: usize, out: &mut [u8]) -> Result<()> {
        out.copy_from_slice(&src[offset..offset + out.len()]);
        Ok(())
    }
    unsafe fn launch(&self, name: &'static str, _cfg: LaunchCfg, _params: &[u8]) -> Result<()> {
        match self.recording.lock().unwrap().as_mut() {
            Some(graph) => graph.push(name),
            None => self.ran.lock().unwrap().push(name),
        }
        Ok(())
    }
    fn synchronize(&self) -> Result<()> {
        Ok(())
    }
    fn begin_capture(&self) -> Result<()> {
        let mut r = self.recording.lock().unwrap();
        if r.is_some() {
            return Err(device_err("already recording"));
        }
        *r = Some(Vec::new());
        Ok(())
    }
    fn end_capture(&self) -> Result<Vec<&'static str>> {
        match self.recording.lock().unwrap().take() {
            Some(g) if !g.is_empty() => Ok(g),
            Some(_) => Err(device_err("recorded no work")),
            None => Err(device_err("not recording")),
        }
    }
    fn replay(&self, graph: &Vec<&'static str>) -> Result<()> {
        self.ran.lock().unwrap().extend(graph);
        Ok(())
    }
}

fn gpu() -> Gpu<Logger> {
    Gpu::new(Logger::new()).expect("a logger backend")
}

fn launch(g: &Gpu<Logger>, name: &'static str) -> Result<()> {
    // SAFETY: the logger runs nothing; the params are never read.
    unsafe { g.launch(name, LaunchCfg::linear(1, 32, 0), &0u32) }
}

fn ran(g: &Gpu<Logger>) -> Vec<&'static str> {
    std::mem::take(&mut *g.device().ran.lock().unwrap())
}

fn recording(e: &Error) -> bool {
    e.to_string().contains("while recording a graph")
}

#[test]
fn a_capture_records_without_running_and_a_replay_runs_the_recording_in_order() {
    let g = gpu();
    launch(&g, "before").unwrap();
    let graph = g
        .capture(&mut || {
            launch(&g, "a")?;
            launch(&g, "b")?;
            launch(&g, "a")
        })
        .expect("a capture");
    assert_eq!(graph.launches(), 3);
    assert_eq!(ran(&g), ["before"], "a recorded launch must not run");
    assert!(g.replay(&graph).unwrap());
    assert!(g.replay(&graph).unwrap());
    assert_eq!(ran(&g), ["a", "b", "a", "a", "b", "a"]);
    assert_eq!(g.launches(), 4, "replays queue no launches of their own");
}

#[test]
fn recording_refuses_memory_traffic_and_synchronisation_and_ends_on_the_error() {
    let g = gpu();
    let mut t = g.alloc(DType::F32, &[4]).unwrap();
    type Step<'a> = Box<dyn Fn(&mut crate::Tensor<<Gpu<Logger> as Backend>::Storage>) -> Result<()> + 'a>;
    let steps: Vec<(&str, Step)> = vec![
        ("alloc", Box::new(|_| g.alloc(DType::F32, &[2]).map(drop))),
        ("write", Box::new(|t| g.write(t, &[0u8; 16]))),
        ("read", Box::new(|t| g.read(t).map(drop))),
        ("synchronize", Box::new(|_| g.synchronize())),
        ("capture", Box::new(|_| g.capture(&mut || launch(&g, "inner")).map(drop))),
    ];
    for (what, step) in &steps {
        let e = g
            .capture(&mut || {
                launch(&g, "k")?;
                step(&mut t)
            })
            .expect_err(what);
        assert!(recording(&e), "{what}: {e}");
        // The capture ended: the device records nothing now, and the backend works.
        assert!(g.device().recording.lock().unwrap().is_none(), "{what}");
        g.write(&mut t, &[1u8; 16]).unwrap();
        assert_eq!(g.read(&t).unwrap(), [1u8; 16]);
        assert!(ran(&g).is_empty(), "{what}: the abandoned recording ran");
    }
}

#[test]
fn a_capture_of_nothing_is_an_error() {
    let g = gpu();
    let e = g.capture(&mut || Ok(())).unwrap_err();
    assert!(e.to_string().contains("recorded no work"), "{e}");
    launch(&g, "after").unwrap();
    assert_eq!(ran(&g), ["after"]);
}

#[test]
fn scratch_cannot_appear_or_grow_while_recording() {
    let g = gpu();
    let e = g.capture(&mut || g.with_scratch("op", &[64], |_| launch(&g, "k"))).unwrap_err();
    assert!(recording(&e) && e.to_string().contains("allocating the scratch of op"), "{e}");
    g.with_scratch("op", &[64], |_| launch(&g, "k")).unwrap();
    // Within what exists: recorded.
    let graph = g.capture(&mut || g.with_scratch("op", &[64], |_| launch(&g, "k"))).unwrap();
    assert_eq!(graph.launches(), 1);
    let e = g.capture(&mut || g.with_scratch("op", &[65], |_| launch(&g, "k"))).unwrap_err();
    assert!(recording(&e) && e.to_string().contains("growing the scratch of op"), "{e}");
    assert!(g.replay(&graph).unwrap(), "a refused growth moves nothing");
}

#[test]
fn a_graph_goes_stale_when_scratch_it_recorded_moves() {
    let g = gpu();
    g.with_scratch("op", &[64], |_| Ok(())).unwrap();
    let graph = g.capture(&mut || g.with_scratch("op", &[64], |_| launch(&g, "k"))).unwrap();
    // Another owner's first buffer frees nothing: still valid.
    g.with_scratch("other", &[1 << 12], |_| Ok(())).unwrap();
    // A larger request within the power-of-two allocation moves nothing either.
    g.with_scratch("op", &[60], |_| Ok(())).unwrap();
    assert!(g.replay(&graph).unwrap());
    assert_eq!(ran(&g), ["k"]);
    // Growing it frees the buffer the graph points into.
    g.with_scratch("op", &[65], |_| Ok(())).unwrap();
    assert!(!g.replay(&graph).unwrap(), "a graph over freed scratch must not replay");
    assert!(ran(&g).is_empty());
    let again = g.capture(&mut || g.with_scratch("op", &[64], |_| launch(&g, "k"))).unwrap();
    assert!(g.replay(&again).unwrap());
    assert_eq!(ran(&g), ["k"]);
}
