//! Exhaustive exploration of a protocol model: [`explore`] visits every state reachable from a
//! [`Model`]'s initial states, breadth first (so a counterexample is a shortest one), and checks
//! each against the model's property. The rate limiter's and the commit protocol's models use it.

use std::collections::{HashMap, VecDeque};
use std::hash::Hash;

/// A system explored state by state.
pub trait Model {
    /// One state of the whole system.
    type State: Clone + Eq + Hash + std::fmt::Debug;
    /// The initial states.
    fn init(&self) -> Vec<Self::State>;
    /// Every state one step from `state`.
    fn next(&self, state: &Self::State) -> Vec<Self::State>;
    /// Whether `state` is acceptable; otherwise why not.
    fn check(&self, state: &Self::State) -> Result<(), String>;
}

/// What an exploration found.
#[derive(Debug, Clone)]
pub struct Explored<S> {
    /// Distinct states visited.
    pub states: usize,
    /// The first property violation, with the path from an initial state to it.
    pub violation: Option<(String, Vec<S>)>,
    /// Whether the state limit stopped the exploration before it was complete.
    pub truncated: bool,
}

/// Visits every state reachable from the model's initial states (at most `max_states`).
pub fn explore<M: Model>(model: &M, max_states: usize) -> Explored<M::State> {
    let mut parent: HashMap<M::State, Option<M::State>> = HashMap::new();
    let mut queue = VecDeque::new();
    for s in model.init() {
        if parent.insert(s.clone(), None).is_none() {
            queue.push_back(s);
        }
    }
    while let Some(state) = queue.pop_front() {
        if let Err(why) = model.check(&state) {
            let mut path = vec![state.clone()];
            let mut at = state;
            while let Some(Some(p)) = parent.get(&at) {
                path.push(p.clone());
                at = p.clone();
            }
            path.reverse();
            return Explored {
                states: parent.len(),
                violation: Some((why, path)),
                truncated: false,
            };
        }
        for n in model.next(&state) {
            if parent.len() >= max_states {
                return Explored {
                    states: parent.len(),
                    violation: None,
                    truncated: true,
                };
            }
            if !parent.contains_key(&n) {
                parent.insert(n.clone(), Some(state.clone()));
                queue.push_back(n);
            }
        }
    }
    Explored {
        states: parent.len(),
        violation: None,
        truncated: false,
    }
}
