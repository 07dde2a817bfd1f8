//! Providers spread over several documents once their allocations outgrow one.
//!
//! A consume writes one document, and that write scans and rewrites the whole document, so a
//! provider whose every allocation sat in one document would make each consume cost in
//! proportion to how many others hold part of it. Instead a provider is kept in *stripes*:
//! stripe 0 is the provider's own document, and each stripe holds
//!
//! - the entries of the requests whose hash (of consumer and request id) ends in the stripe's
//!   number, written in `bits` binary digits, and
//! - a *share* of the provider's limit (its `limit`), with its usage and `available` as before.
//!
//! The shares add up to the provider's limit at every moment (only transactions move them), and
//! every consume is conditional on its stripe's `available`, so the provider as a whole is never
//! over its limit. A request's entry is always in the stripe its hash addresses, so the
//! single-write consume's condition "this request is not recorded yet" still sees every earlier
//! copy of the request.
//!
//! **Splitting.** A consume's condition also asks that its stripe hold fewer than
//! [`STRIPE_ENTRIES`] entries. A full stripe is split in one transaction: stripe `a` with `bits =
//! l` becomes stripes `a` and `a + 2^l`, both with `l + 1` bits, its entries going by the next bit
//! of their hash and its free share halved between them; stripe 0 records the new layout. The
//! split bumps the stripe's `bits`, which every consume names in its condition, so a copy sent
//! under the old layout (late, or from a process that has not seen the split) matches nothing
//! and its sender re-reads the layout. Stripes only split, never merge, so a stripe whose `bits`
//! is what the sender expected still holds exactly the hashes it did.
//!
//! **Borrowing.** A stripe without room for a consume while the provider has it takes share from
//! the others (most free first) in one transaction conditioned on every stripe's generation,
//! and the consume is tried again; when the whole provider lacks room the consume is refused
//! with the provider's own numbers. So no capacity is lost to the striping.
//!
//! This file plans (no I/O); `access` reads and writes.
//!
//! Cost: a consume addresses its stripe from a layout the handle caches (one round trip when the
//! cache is current, as before), and writes a document of at most [`STRIPE_ENTRIES`] entries,
//! whatever the provider holds. A provider with few allocations keeps a single stripe and is
//! stored exactly as before.

use std::collections::BTreeMap;

use bson::DateTime;
use sha2::{Digest, Sha256};

use crate::quota::decide::{Docs, Write};
use crate::quota::error::Refusal;
use crate::quota::model::{Entry, Part, ProviderDoc, StripeId};

/// The most entries a stripe takes before it is split (released requests kept against late
/// copies count too). A consume rewrites one stripe, so this bounds its cost.
pub(crate) const STRIPE_ENTRIES: usize = 32;

/// The most bits a stripe is addressed by: past this (2^40 stripes, more than any provider could
/// fill) a stripe grows instead of splitting.
const MAX_BITS: i64 = 40;

/// The hash that addresses a request's stripe: stable across processes, versions and platforms
/// (a standard digest, not the standard library's hasher, whose output may change).
pub(crate) fn hash(consumer: &str, request: &str) -> u64 {
    let mut digest = Sha256::new();
    digest.update(consumer.as_bytes());
    // Names hold no control characters (`decide::check_name`), so this separates them.
    digest.update([0u8]);
    digest.update(request.as_bytes());
    let bytes = digest.finalize();
    let mut first = [0u8; 8];
    first.copy_from_slice(&bytes[..8]);
    u64::from_le_bytes(first)
}

/// Which stripes a provider has, and how many bits address each.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Layout(BTreeMap<i64, i64>);

impl Layout {
    /// A provider stored in one document.
    pub(crate) fn single() -> Layout {
        Layout([(0, 0)].into_iter().collect())
    }

    /// The layout stripe 0 records.
    pub(crate) fn of(head: &ProviderDoc) -> Layout {
        if head.stripes.is_empty() {
            return Layout([(0, head.bits)].into_iter().collect());
        }
        Layout(head.stripes.iter().map(|p| (p.s, p.bits)).collect())
    }

    pub(crate) fn is_single(&self) -> bool {
        self.0.len() == 1
    }

    /// How many stripes.
    pub(crate) fn len(&self) -> usize {
        self.0.len()
    }

    /// The bits of stripe `stripe`, if it is one.
    pub(crate) fn bits_of(&self, stripe: i64) -> Option<i64> {
        self.0.get(&stripe).copied()
    }

    /// Every stripe number.
    pub(crate) fn stripes(&self) -> impl Iterator<Item = i64> + '_ {
        self.0.keys().copied()
    }

    /// The stripe holding hash `h`, and its bits; `None` for a layout that does not cover it
    /// (stored inconsistently).
    pub(crate) fn locate(&self, h: u64) -> Option<(i64, i64)> {
        let (mut stripe, mut bits) = (0_i64, 0_i64);
        loop {
            let stored = *self.0.get(&stripe)?;
            if stored == bits {
                return Some((stripe, bits));
            }
            if stored < bits || bits >= MAX_BITS {
                return None;
            }
            bits += 1;
            stripe = i64::try_from(h % (1_u64 << bits)).ok()?;
        }
    }

    fn parts(&self) -> Vec<Part> {
        self.0.iter().map(|(&s, &bits)| Part { s, bits }).collect()
    }
}

/// What to do about a full stripe.
#[derive(Debug)]
pub(crate) enum Full {
    /// Forgetting its released requests made room: write it back.
    Prune(Write),
    /// Write these (the stripe, and stripe 0 when it is another) and insert the new stripe.
    Divide {
        writes: Vec<Write>,
        new: ProviderDoc,
    },
    /// It cannot split further (or is not full any more): leave it.
    Keep,
}

/// Plans splitting `stripe` (read at `generation`), given stripe 0 when that is another document.
pub(crate) fn split(
    head: Option<&(i64, ProviderDoc)>,
    (generation, stripe): (i64, &ProviderDoc),
    now: DateTime,
) -> Full {
    let mut old = stripe.clone();
    let before = old.held.len();
    old.held
        .retain(|e| !(e.is_tombstone() && e.dl.is_none_or(|dl| dl <= now)));
    if old.held.len() < STRIPE_ENTRIES {
        return if old.held.len() == before {
            Full::Keep
        } else {
            Full::Prune(Write {
                generation,
                doc: old,
            })
        };
    }
    if old.bits >= MAX_BITS {
        return Full::Keep;
    }
    // A stripe short of its own share is so only under a lowered limit (borrowing moves free
    // share alone): the provider is over, and both halves must say so until a reading of every
    // stripe finds it back under (`borrow`), or the half that got the free entries would grant.
    old.over |= old.available < 0;
    let bits = old.bits + 1;
    let number = old.id.stripe + (1_i64 << old.bits);
    let provider = old.id.provider();
    let goes = |e: &Entry| hash(&e.c, &e.r) % (1_u64 << bits) == number.unsigned_abs();
    let (moved, kept): (Vec<Entry>, Vec<Entry>) = old.held.drain(..).partition(goes);
    old.held = kept;
    let moved_usage: i64 = moved.iter().map(|e| e.n).sum();
    let free = old.available.max(0);
    let new_limit = (moved_usage + free / 2).min(old.limit);
    let new = ProviderDoc {
        id: StripeId::new(&provider, number),
        limit: new_limit,
        usage: moved_usage,
        available: new_limit - moved_usage,
        parent: old.parent.clone(),
        ancestors: old.ancestors.clone(),
        held: moved,
        bits,
        stripes: Vec::new(),
        over: old.over,
    };
    old.limit -= new_limit;
    old.usage -= moved_usage;
    old.available = old.limit - old.usage;
    old.bits = bits;
    let mut layout = match head {
        Some((_, head)) => Layout::of(head),
        None => Layout::of(stripe),
    };
    layout.0.insert(old.id.stripe, bits);
    layout.0.insert(number, bits);
    let mut writes = Vec::new();
    match head {
        Some((head_generation, head)) => {
            let mut head = head.clone();
            head.stripes = layout.parts();
            writes.push(Write {
                generation: *head_generation,
                doc: head,
            });
        }
        None => old.stripes = layout.parts(),
    }
    writes.push(Write {
        generation,
        doc: old,
    });
    Full::Divide { writes, new }
}

/// Plans moving share into `target` from the provider's other stripes (`all`, every stripe of
/// one provider) so that it has `need` available and a fair part of what else is free; the
/// provider's own refusal when all its stripes together lack `need`.
pub(crate) fn borrow(all: &Docs, target: &StripeId, need: i64) -> Result<Vec<Write>, Refusal> {
    let (limit, available) = all.values().fold((0_i64, 0_i64), |(l, a), (_, d)| {
        (l.saturating_add(d.limit), a.saturating_add(d.available))
    });
    let Some((_, (_, to))) = all.iter().find(|(id, _)| *id == target) else {
        return Err(Refusal {
            provider: target.provider(),
            requested: need,
            available,
            limit,
        });
    };
    if available < need {
        return Err(Refusal {
            provider: target.provider(),
            requested: need,
            available,
            limit,
        });
    }
    // Usage fell back under a lowered limit: share it out afresh, which also lifts `over`.
    if all.values().any(|(_, d)| d.over) {
        return Ok(share(all, limit));
    }
    let count = i64::try_from(all.len()).unwrap_or(i64::MAX).max(1);
    let mut wanted = (need - to.available).max(0) + (available - need) / count;
    let mut donors: Vec<(&StripeId, &(i64, ProviderDoc))> = all
        .iter()
        .filter(|(id, (_, d))| *id != target && d.available > 0)
        .collect();
    donors.sort_by_key(|(_, (_, d))| std::cmp::Reverse(d.available));
    let mut writes = Vec::new();
    let mut moved = 0;
    for (_, (generation, donor)) in donors {
        if wanted == 0 {
            break;
        }
        let take = donor.available.min(wanted);
        let mut donor = donor.clone();
        donor.limit -= take;
        donor.available -= take;
        writes.push(Write {
            generation: *generation,
            doc: donor,
        });
        wanted -= take;
        moved += take;
    }
    let (generation, to) = &all[target];
    let mut to = to.clone();
    to.limit += moved;
    to.available += moved;
    writes.push(Write {
        generation: *generation,
        doc: to,
    });
    Ok(writes)
}

/// `docs` (the one stripe a request addresses, as read for it) with the share `borrowed` (writes
/// planned from a later reading of every stripe) moved in, and the other stripes' writes.
/// `None` when the later reading shows the stripe split since: its entries are then addressed
/// by one more bit, and the request's entry may belong in the new stripe, where a resend would
/// look for it (putting it here would let that resend take a second time).
pub(crate) fn lend(
    docs: &Docs,
    stripe: &StripeId,
    borrowed: Vec<Write>,
) -> Option<(Docs, Vec<Write>)> {
    let (_, read) = docs.get(stripe)?;
    let mut lent = docs.clone();
    let mut others = Vec::new();
    for write in borrowed {
        if write.doc.id != *stripe {
            others.push(write);
        } else if write.doc.bits == read.bits {
            lent.insert(stripe.clone(), (write.generation, write.doc));
        } else {
            return None;
        }
    }
    Some((lent, others))
}

/// The writes giving a provider (`all`, every stripe of it, read at once) the limit `limit`:
/// a provider of one stripe is given it whole, a striped one shares it out.
pub(crate) fn new_limit(all: &Docs, limit: i64) -> Vec<Write> {
    match all.values().collect::<Vec<_>>()[..] {
        [(generation, doc)] if doc.is_whole() => vec![Write {
            generation: *generation,
            doc: crate::quota::decide::set_limit(doc, limit),
        }],
        _ => share(all, limit),
    }
}

/// Plans giving a striped provider the limit `limit`: each stripe keeps a share covering its
/// usage while the limit allows, and the rest is spread evenly. Below the provider's usage every
/// stripe is marked `over`: a release would otherwise give a stripe room while the provider as
/// a whole is still over its limit. Every stripe is written, so that
/// the writes (each conditional on the version read) also prove the shares were read at once.
pub(crate) fn share(all: &Docs, limit: i64) -> Vec<Write> {
    let count = i64::try_from(all.len()).unwrap_or(i64::MAX).max(1);
    let over = all.values().map(|(_, d)| d.usage).sum::<i64>() > limit;
    let mut left = limit;
    let mut shares: Vec<i64> = all
        .values()
        .map(|(_, d)| {
            let share = d.usage.clamp(0, left);
            left -= share;
            share
        })
        .collect();
    let (each, first) = (left / count, left % count);
    for (i, s) in shares.iter_mut().enumerate() {
        *s += each + if i == 0 { first } else { 0 };
    }
    all.values()
        .zip(shares)
        .map(|((generation, d), share)| {
            let mut doc = d.clone();
            doc.limit = share;
            doc.available = share - doc.usage;
            doc.over = over;
            Write {
                generation: *generation,
                doc,
            }
        })
        .collect()
}

#[cfg(test)]
mod tests;
