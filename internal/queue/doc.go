// Package queue is the protocol every primitive of the package etcdsync
// shares, in one place for a reviewer (docs/protocol.md walks through it,
// step by step): names to keys, the enqueue transaction, the wait on the
// nearest keys, the turn on one watch, the held key and its loss watch, the
// fenced release, the sweeper of stray keys, what is learned of a client's
// servers (a serializable read that came back behind), and the session's
// lease, keepalive and local deadline.
//
//   - slot.go: a contender's place (Slot), the blocking rules (Rule) and the
//     acquire step (acquireSlots), with its cleanup.
//   - turn.go: the enqueue transaction, a key's turn (turn) and the wait's
//     watches (stream).
//   - hold.go: the held key (Hold: guard, Do, loss watch, fenced release) and
//     a primitive value's state between calls (Holder).
//   - registry.go: the session's key claims and its sweepers (registry).
//   - session.go: the lease, its keepalive and local deadline (Session), and
//     what it reports (Reports); options.go: its settings (Options).
//   - run.go: what a Run's context carries (ctxHold); caps.go: what is
//     learned of a client's servers; errors.go: the sentinels.
//
// Arrows run one way: the package etcdsync imports this one, never the
// reverse. Its primitives are "which keys block whom" (a Rule) on a
// Holder; its Session wraps a Session of this package. Every request goes
// through the client's interfaces (KV, Watcher, Lease, Maintenance).
package queue
