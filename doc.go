// Package etcdsync provides distributed coordination primitives on etcd:
//
//   - Session: a lease kept alive in the background, with a local deadline
//     that never passes the server's expiry (Done, Err, Deadline).
//   - Mutex: an exclusive lock on a name (Lock, TryLock, Unlock, Run,
//     TryRun, Do, Check).
//   - Election and Observer: leader election on a name (Campaign,
//     TryCampaign, Proclaim, Resign, Handover, Run, TryRun, Leader, Observe,
//     Check), and a follower that needs no session (Observe, and Terms, which
//     also reports "no leader").
//   - RWMutex: readers share, a writer is alone (RLock, Lock, RRun, Run and
//     their try forms).
//   - Semaphore: a capacity of permits, a holder takes n (Acquire, Release,
//     Run, TryRun).
//   - MultiLock: several names held as one, all or none, never deadlocking
//     whatever order they are named in (Lock, TryLock, Unlock, Run, TryRun,
//     Do, Rev per name, Done, Check); NewMultiLockOf mixes in RWMutex sides.
//   - Group: membership with a value (Join, Leave, Done), and the members
//     exact at a revision, read once (Members, GroupMembers) or kept by one
//     watch (Watch, WatchGroup).
//   - Barrier and DoubleBarrier: hold processes until a barrier is released
//     (Hold, HoldFor, Release, Wait), and start and finish a phase with
//     count parties (Enter, Leave), on the keys of etcd's recipes.
//
// It mirrors go.etcd.io/etcd/client/v3/concurrency, so switching is a change
// of import path plus WithTTL taking a time.Duration, and it writes the same
// keys (NAME/<lease-hex>), so a fleet that mixes the two still excludes each
// other.
//
// # The queue and what it costs
//
// Every primitive is one recipe. A contender writes one key under the name,
// bound to its session's lease, in one create-if-absent transaction that also
// lists the queue (1 RPC, 1 write). Only direct children NAME/<hex> of the
// name take part (an RWMutex's are NAME/read/<hex> and NAME/write/<hex>, the
// layout of etcd's recipes), so a lock on "/a/b" never blocks a lock on "/a".
// "/a" and "/a/" are two names: their keys are /a/<id> and /a//<id>, as
// etcd's clients write them.
// The oldest key holds; which older keys block a contender is the
// primitive's rule (every one for a Mutex or an Election; writers for a
// reader; enough weight to fill the capacity for a Semaphore).
//
// A waiter that lists every key that blocks it (a Mutex's first two
// waiters) watches the name's whole prefix on one watch: when its
// predecessor's delete arrives and nothing else is ahead, the turn is its
// own with no RPC, as etcd sends the events of one revision in one response
// and a watch's events in order, so its own key's delete would have come
// with it or before. A waiter further back watches its own key and the two
// nearest keys that block it, and reads what is left ahead when one of them
// goes, off the critical path. A
// release of a Mutex or an Election reaches at most two waiters at any queue
// length; an RWMutex writer's release reaches every reader it lets in (and
// the readers waiting behind a writer get every release under the name
// while they wait, which wakes them for nothing), and a Semaphore's at most
// about capacity+1 waiters, never the whole queue. A
// release (Unlock, Resign, Release) is one fenced RPC; TryLock on a held name is one RPC and writes
// nothing. Every request goes through the client's interfaces (KV, Watcher,
// Lease, Maintenance), so a client wrapped by clientv3/namespace, the
// in-process client of an embedded etcd, a client behind etcd's gRPC proxy
// and a user's own wrappers all see every call.
//
// The protocol every primitive shares lives in one package of this module,
// internal/queue; docs/protocol.md walks through it step by step, with each
// invariant below, the code that keeps it and the tests that pin it.
//
// # Invariants
//
// These hold for every primitive; the tests cite them by name.
//
//   - Exclusion: at most one holder of a Mutex or Election at any revision
//     (for RWMutex: readers or one writer; for Semaphore: held weight within
//     capacity), across processes, sessions, values on one Session and
//     goroutines sharing a value.
//   - Interop: the keys are the ones etcdctl lock, etcd's concurrency package
//     and the server's lock and election APIs write, so they exclude each
//     other.
//   - Nested names: a holder of NAME/x never blocks NAME.
//   - FIFO: waiters are served in the order their keys were created, and a
//     waiter is woken only by the deletes of the keys it watches, so a release
//     wakes only the waiters watching its key, never the whole queue (no
//     herd): at most two for a Mutex or an Election.
//   - Nothing left: a cancelled or failed acquire leaves no key, also when the
//     cancel races the create or the server applies the create late (when
//     etcd cannot be reached as the call returns, its session removes the key
//     once etcd answers); a closed Session leaves no key.
//   - Own loss: a waiter whose own key vanishes (lease expired or revoked, key
//     deleted) returns ErrSessionExpired at once.
//   - Fenced release: a release deletes only the key at the revision it
//     holds, so a retried release never deletes a later hold; a failed one
//     can be retried.
//   - Loss signal: Done closes when a hold ends for any reason, with the cause
//     in Err (or context.Cause of Run's context); after lost contact, at
//     least the slack (WithSlack: by default the larger of 2s and a tenth of
//     the TTL) before the server can expire the lease, so a holder whose
//     process runs late by up to the slack is told before anyone else holds.
//   - Fencing: Rev is the create revision of the held key, strictly
//     increasing from one holder to the next; Do runs operations only while
//     the hold is current and returns ErrNotHeld otherwise.
//   - Truthful observer: Observe and Terms report only leaders, and only keys
//     of the election; Terms reports "no leader" when a leader goes with
//     nobody queued, never while a queued candidate takes over.
//   - Handover: a successor never leads while the work of the leader that
//     hands over (Election.Handover) still runs under Run.
//   - Newest value: a Proclaim applied late never overwrites a newer one of
//     the same term.
//
// # Leadership as services run it
//
// Handover steps down for a rolling deploy; TryCampaign and the TryRun forms
// never queue; WithLockDelay keeps a name from the next holder for a while
// after its holder lost contact (the delay rides on the holder's lease); and
// Check answers, without an RPC, whether a session lives and a hold is
// current, for a service's health endpoint.
//
// # Reentrancy
//
// Lock, RLock, Campaign and Acquire are not reentrant, like sync.Mutex: a
// second Lock on a held Mutex waits for its Unlock. Run is: inside fn, a Run
// of the same session and name given fn's context enters the hold that is
// already there and returns without releasing it (a read RRun inside a
// write Run runs at once; a write Run inside a read RRun is an error, not a
// deadlock).
package etcdsync
