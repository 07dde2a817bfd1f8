//! The rate limiter shared by workers on different hosts (in progress): so far the model of its
//! reservation protocol, checked exhaustively against the naive check-then-call it replaces.
//!
//! The protocol ([`model::ReservationModel`]): a worker reserves calls before making them; the
//! limiter grants a reservation only if every window of the limit's length that can contain its
//! calls still has room, counting every outstanding reservation in full and every settled one as
//! the calls it made; settling returns the unused calls at once; a worker that dies holding a
//! reservation leaves it counted in full until no window can contain it any more, so a dead
//! worker costs at most its reservation for one window and never causes an overrun.

pub mod model;
