// Package queue is the protocol every primitive of the package etcdsync
// shares, in one place for a reviewer (docs/protocol.md walks through it,
// step by step): names to keys, the enqueue transaction, the wait (the
// front of a queue on one watch of the prefix and its turn on the event,
// the others on a few keys ahead), the held key and its loss watch, the
// fenced release, the sweeper of stray keys, what is learned of a client's
// servers (a serializable read that came back behind), and the session's
// lease, keepalive and local deadline.
//
//   - slot.go: a contender's key on a name (Slot), its acquire and the
//     withdrawal of a key it may have written; rule.go: the blocking rules
//     (Rule); acquire.go: the acquire step (acquireSlots), with its cleanup.
//   - enqueue.go: the enqueue transaction; place.go: a key's place in its
//     queue (place: the keys ahead, the front, the keys watched); turn.go:
//     the wait for its turn on deletes (turn); stream.go: the wait's watches
//     on a gRPC stream of its own (stream), and their closing (reap).
//   - hold.go: the held key (Hold: Done, loss watch, guard, Do and fenced
//     release); watchgone.go: the watch of a key until it is gone; fence.go:
//     the release of several holds in one transaction; holder.go: a
//     primitive value's state between calls (Holder).
//   - registry.go: the session's key claims and its sweepers (registry).
//   - session.go: the lease's life and end, and the goroutines the session
//     owns (Session), and what it reports (Reports); start.go: the grant or
//     adoption; keepalive.go: the keepalive and local deadline; options.go:
//     its settings (Options).
//   - run.go: what a Run's context carries (ctxHold), and the Runs under a
//     hold as a Handover sees them (runSet); caps.go: what is
//     learned of a client's servers; errors.go: the sentinels.
//
// Arrows run one way: the package etcdsync imports this one, never the
// reverse. Its primitives are "which keys block whom" (a Rule) on a
// Holder; its Session wraps a Session of this package. Every request goes
// through the client's interfaces (KV, Watcher, Lease, Maintenance).
package queue
