//! Attaching the TC program to devices so that it stays attached without the agent.
use std::{io, path::Path};

use anyhow::Context as _;
use aya::{
    programs::{
        links::{FdLink, LinkError, PinnedLink},
        tc::{self, SchedClassifierLink, TcAttachOptions},
        LinkOrder, SchedClassifier, TcAttachType,
    },
    sys::SyscallError,
};
use proxy_common::pins;
use tracing::{debug, info, warn};

use super::PinDir;

/// How the program is attached to one device.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Attachment {
    /// A TCX link, pinned so it stays attached without the agent.
    Tcx,
    /// A clsact filter (kernels before 6.6); it stays attached until removed by name.
    Clsact,
}

/// Attaches `program` at ingress of `device`. A TCX link pinned by an earlier agent is
/// updated in place (the kernel swaps the program atomically, no packet sees a gap); a stale
/// one (its device is gone) is replaced.
pub fn attach(program: &mut SchedClassifier, device: &str, link_pin: &Path) -> anyhow::Result<Attachment> {
    match PinnedLink::from_pin(link_pin) {
        Ok(pinned) => {
            let link = SchedClassifierLink::try_from(FdLink::from(pinned))?;
            match program.attach_to_link(link) {
                Ok(id) => {
                    // Converting to FdLink releases aya's ownership without detaching; the pin
                    // keeps the link alive.
                    let _: FdLink = program.take_link(id)?.try_into()?;
                    return Ok(Attachment::Tcx);
                }
                Err(error) => {
                    warn!(device, %error, "the pinned link cannot be updated; attaching anew");
                    std::fs::remove_file(link_pin)?;
                }
            }
        }
        Err(LinkError::SyscallError(SyscallError { io_error, .. }))
            if io_error.kind() == io::ErrorKind::NotFound => {}
        Err(error) => return Err(error.into()),
    }
    match program.attach_with_options(
        device,
        TcAttachType::Ingress,
        TcAttachOptions::TcxOrder(LinkOrder::default()),
    ) {
        Ok(id) => {
            let link: FdLink = program.take_link(id)?.try_into()?;
            link.pin(link_pin).with_context(|| format!("cannot pin the link at {}", link_pin.display()))?;
            Ok(Attachment::Tcx)
        }
        Err(tcx_error) => {
            debug!(device, %tcx_error, "TCX attach failed; falling back to clsact");
            if let Err(error) = tc::qdisc_add_clsact(device) {
                debug!(device, %error, "clsact qdisc not added (it usually exists already)");
            }
            detach_clsact(device);
            let id = program
                .attach_with_options(
                    device,
                    TcAttachType::Ingress,
                    TcAttachOptions::Netlink(Default::default()),
                )
                .with_context(|| format!("TCX failed ({tcx_error}) and so did clsact"))?;
            // A clsact filter lives until removed; dropping aya's handle would remove it now.
            std::mem::forget(program.take_link(id)?);
            Ok(Attachment::Clsact)
        }
    }
}

pub fn detach_clsact(device: &str) {
    match tc::qdisc_detach_program(device, TcAttachType::Ingress, pins::TC_INGRESS_PROGRAM) {
        Ok(()) => info!(device, "detached a clsact filter"),
        Err(error) => debug!(device, %error, "no clsact filter detached"),
    }
}

/// Links pinned for devices that are no longer served are detached, so that dropping a device
/// from `--devices` really stops vipr there.
pub fn detach_stale_links(pin_dir: &PinDir, devices: &[String]) -> anyhow::Result<()> {
    for entry in std::fs::read_dir(pin_dir.links())? {
        let path = entry?.path();
        let name = path.file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_default();
        if devices.contains(&name) {
            continue;
        }
        match PinnedLink::from_pin(&path) {
            Ok(pinned) => drop(pinned.unpin()?),
            Err(_) => std::fs::remove_file(&path)?,
        }
        info!(device = name, "detached from a device no longer in --devices");
    }
    Ok(())
}
